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


def server_gone(why):
    """The rank server is gone (or never answered): the forked rank, if there was one, died
    with it (its parent-death signal). This process, which stands for the rank, dies the
    same way, so that its worker judges a dead rank whenever it happened - not the
    program's own failure, as an exit code before the rank connected would read."""
    sys.stderr.write(f"podsim: {why}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
deadline = time.monotonic() + 30
while True:
    try:
        conn.connect("\0" + os.environ["PODSIM_PREFORK_SOCKET"])
        break
    except OSError as e:
        if time.monotonic() > deadline:
            server_gone(f"cannot reach the rank server {os.environ['PODSIM_PREFORK_SOCKET']}: {e}")
        time.sleep(0.05)
body = json.dumps({
    "python": sys.executable,
    "args": sys.argv[1:],
    "env": dict(os.environ),
    "cwd": os.getcwd(),
    "pgid": os.getpgrp(),
}).encode()
said = b""
try:
    socket.send_fds(conn, [struct.pack("!I", len(body)) + body], [0, 1, 2])
    while chunk := conn.recv(4096):
        said += chunk
except OSError:
    pass  # the server went mid-conversation: what it said, if anything, is below
for line in said.decode(errors="replace").splitlines():
    what, _, value = line.partition(" ")
    if what == "refused":
        sys.stderr.write(f"podsim: the rank server refused this rank: {value}\n")
        os._exit(2)
    if what == "exit":
        os._exit(int(value))
    if what == "signal":
        # End as the rank ended. SIGKILL and SIGSTOP take no handler (setting one raises), and
        # need none to be restored.
        if int(value) not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(int(value), signal.SIG_DFL)
        os.kill(os.getpid(), int(value))
        time.sleep(1)
        os._exit(128 + int(value))
server_gone("the rank server ended before this rank did")
