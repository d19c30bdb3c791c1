"""The frames between a rank and the chip that serves it (``links/src/rank_wire.rs``).

Each frame: a 16-byte header (``PDT1``, the JSON length as u32, the payload length as u64,
little-endian), a JSON object, then the payload: float32 values in the host's byte order.
"""

import ctypes
import json
import os
import socket
import struct
import threading
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    import torch

_HEADER = struct.Struct("<IIQ")
_MAGIC = int.from_bytes(b"PDT1", "little")


class PodsimError(RuntimeError):
    """A call the emulated pod refused (the message says what and why)."""


class Connection:
    """One rank's socket to its chip: a request, then its reply, one caller at a time."""

    def __init__(self, name: str, rank: int, token: str):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The chip's socket lives in Linux's abstract namespace.
        self._sock.connect("\0" + name)
        self._lock = threading.RLock()
        reply, _ = self.call({"op": "hello", "rank": rank, "pid": os.getpid(), "token": token})
        del reply

    def send(self, request: dict, payload: Optional["torch.Tensor"] = None) -> None:
        """Sends a frame that has no reply (a stack report)."""
        with self._lock:
            self._send(request, payload)

    def call(self, request: dict, payload: Optional["torch.Tensor"] = None,
             out: Optional["torch.Tensor"] = None) -> Tuple[dict, Optional["torch.Tensor"]]:
        """Sends `request` (and `payload`, a contiguous float32 tensor) and returns the reply
        and its payload: read into `out` (a float32 tensor of the right size) when given."""
        with self._lock:
            self._send(request, payload)
            return self._receive(out)

    def _send(self, request, payload):
        body = json.dumps(request, separators=(",", ":")).encode()
        data = _bytes_of(payload) if payload is not None else None
        size = data.nbytes if data is not None else 0
        self._sock.sendall(_HEADER.pack(_MAGIC, len(body), size) + body)
        if size:
            self._sock.sendall(data)

    def _receive(self, out):
        magic, json_len, payload_len = _HEADER.unpack(self._exact(_HEADER.size))
        if magic != _MAGIC:
            raise PodsimError(f"podsim: a reply out of step (magic {magic:#x})")
        reply = json.loads(self._exact(json_len))
        values = None
        if payload_len:
            import torch

            count = payload_len // 4
            if out is None or out.numel() != count or out.dtype != torch.float32:
                out = torch.empty(count, dtype=torch.float32)
            view = _bytes_of(out)
            got = 0
            while got < payload_len:
                n = self._sock.recv_into(view[got:], payload_len - got)
                if n == 0:
                    raise PodsimError("podsim: the chip closed the connection")
                got += n
            values = out
        if reply.get("error"):
            raise PodsimError(f"podsim: {reply['error']}")
        return reply, values

    def _exact(self, n):
        chunks = []
        while n:
            chunk = self._sock.recv(n)
            if not chunk:
                raise PodsimError("podsim: the chip closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def _bytes_of(tensor):
    """The bytes of a contiguous CPU tensor, without a copy, the tensor itself untouched: not
    through `tensor.numpy()`, which marks its storage as not resizable for good, and FSDP
    frees and refills the storages it hands a collective (`UntypedStorage.resize_`; FSDP1
    failed with "Trying to resize storage that is not resizable")."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    window = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    window.tensor = tensor  # the memory lives as long as the view
    return memoryview(window).cast("B")
