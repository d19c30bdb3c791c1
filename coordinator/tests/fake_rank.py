"""A rank speaking podsim's rank protocol with the standard library only (no torch), for the
tests of `podsim run` that must not need torch: what it does is chosen by FAKE_RANK_DO."""

import json
import os
import socket
import struct
import sys

HEADER = struct.Struct("<IIQ")
MAGIC = int.from_bytes(b"PDT1", "little")
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
do = os.environ.get("FAKE_RANK_DO", "sum")

s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + os.environ["PODSIM_SOCKET"])


def exact(n):
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            sys.exit(f"rank {rank}: the chip closed the connection")
        out += chunk
    return out


def call(request, values=()):
    body = json.dumps(request).encode()
    payload = struct.pack(f"<{len(values)}f", *values)
    s.sendall(HEADER.pack(MAGIC, len(body), len(payload)) + body + payload)
    magic, json_len, payload_len = HEADER.unpack(exact(HEADER.size))
    reply = json.loads(exact(json_len))
    got = struct.unpack(f"<{payload_len // 4}f", exact(payload_len))
    return reply, list(got)


token = os.environ["PODSIM_TOKEN"] if do != "wrong-token" else "not-the-token"
reply, _ = call({"op": "hello", "rank": rank, "pid": os.getpid(), "token": token})
if reply.get("error"):
    print(f"refused: {reply['error']}")
    sys.exit(0)
call({"op": "group", "id": 0, "ranks": [[0, world, 1]]})
if do == "garbage" and rank == 1:
    s.sendall(b"this is not a frame at all, not even close.")
    s.recv(1)
    sys.exit(0)
if do == "exit" and rank == 2:
    sys.exit(7)
reply, got = call({"op": "all_reduce", "group": 0, "reduce": "sum", "dtype": "f32",
                   "compute": {"matmuls": [[256, 256, 256, 4, 4]], "pass_bytes": 1 << 20, "kernels": 3}},
                  [float(rank), 1.0])
want = [float(sum(range(world))), float(world)]
print(f"rank {rank} sum {got} {'ok' if got == want else 'WRONG'}")
reply, bad = call({"op": "group", "id": 1, "ranks": [[0, 2, 3]]}) if world == 4 else ({}, [])
if reply.get("error"):
    print(f"rank {rank} refused group: {reply['error']}")
# A ring shift by point-to-point messages (rank 3 to rank 0 crosses both axes of 2x2), and
# a send to itself, refused at the call.
nxt, prv = (rank + 1) % world, (rank - 1) % world
call({"op": "send", "peer": nxt, "tag": 5}, [10.0 * rank, -1.0])
reply, got = call({"op": "recv", "peer": prv, "tag": 5, "count": 2})
print(f"rank {rank} shift {got} {'ok' if got == [10.0 * prv, -1.0] else 'WRONG'}")
reply, _ = call({"op": "send", "peer": rank}, [1.0])
if reply.get("error"):
    print(f"rank {rank} refused send: {reply['error']}")
call({"op": "step"})
call({"op": "bye"})
