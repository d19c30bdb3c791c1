# A rank's own process when the job's ranks are forked by a rank server
# (python/podsim/_prefork.py): run as `python -S -c THIS ARGS` by the worker, which watches,
# kills and reaps it as the rank. It hands the server its standard streams, interpreter,
# arguments, environment, directory and process group, then exits as the forked rank exits.
import json
import os
import signal
import socket
import struct
import sys
import time

conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
deadline = time.monotonic() + 30
while True:
    try:
        conn.connect("\0" + os.environ["PODSIM_PREFORK_SOCKET"])
        break
    except OSError as e:
        if time.monotonic() > deadline:
            sys.stderr.write(f"podsim: cannot reach the rank server {os.environ['PODSIM_PREFORK_SOCKET']}: {e}\n")
            os._exit(1)
        time.sleep(0.05)
body = json.dumps({
    "python": sys.executable,
    "args": sys.argv[1:],
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "pgid": os.getpgrp(),
}).encode()
socket.send_fds(conn, [struct.pack("!I", len(body)) + body], [0, 1, 2])
said = b""
while True:
    chunk = conn.recv(4096)
    if not chunk:
        break
    said += chunk
for line in said.decode(errors="replace").splitlines():
    what, _, value = line.partition(" ")
    if what == "refused":
        sys.stderr.write(f"podsim: the rank server refused this rank: {value}\n")
        os._exit(2)
    if what == "exit":
        os._exit(int(value))
    if what == "signal":
        signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
        time.sleep(1)
        os._exit(128 + int(value))
sys.stderr.write("podsim: the rank server ended before this rank did\n")
os._exit(1)
