"""Counts the compute a rank runs between collectives, at torch's dispatcher, for the chip's
virtual clock: matrix products by shape (the kernel model pads them to the MXU), everything
else as bytes through HBM and a number of kernels.

Views and other ops that move no data cost nothing. Tensor subclasses (DTensor, FSDP2's
parameters) are left to their own dispatch, so their local ops are counted once, on the local
shapes that really run on this chip.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that create no kernel on an accelerator (metadata, aliasing).
_FREE = {
    aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand,
    aten.as_strided, aten.detach, aten.alias, aten.unsqueeze, aten.squeeze, aten.reshape,
    aten.slice, aten.select, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
    aten.lift_fresh, aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
    aten.new_empty_strided,
    aten.is_same_size, aten.sym_size, aten.sym_stride, aten.sym_numel,
}


def _matmul_shapes(packet, args):
    """`(m, k, n, batch)` of a matrix product, or None."""
    if packet in (aten.mm,):
        a, b = args[0], args[1]
        return a.shape[0], a.shape[1], b.shape[1], 1
    if packet in (aten.addmm,):
        a, b = args[1], args[2]
        return a.shape[0], a.shape[1], b.shape[1], 1
    if packet in (aten.bmm,):
        a, b = args[0], args[1]
        return a.shape[1], a.shape[2], b.shape[2], a.shape[0]
    if packet in (aten.baddbmm,):
        a, b = args[1], args[2]
        return a.shape[1], a.shape[2], b.shape[2], a.shape[0]
    return None


def _tensor_bytes(x):
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0


class Compute(TorchDispatchMode):
    """A dispatch mode accumulating the compute of every op since the last `take()`."""

    def __init__(self):
        super().__init__()
        self._matmuls = {}
        self._pass_bytes = 0
        self._kernels = 0
        # Set while podsim itself moves tensors (a collective's copies are not compute).
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and t is not torch.nn.Parameter for t in types):
            # A tensor subclass: its own dispatch runs the local ops, which come back here.
            return NotImplemented
        out = func(*args, **kwargs)
        if self.paused:
            return out
        try:
            self._count(func, args, out)
        except Exception:  # counting must never break the user's program
            pass
        return out

    def _count(self, func, args, out):
        packet = func.overloadpacket
        if packet in _FREE or getattr(func, "is_view", False):
            return
        shapes = _matmul_shapes(packet, args)
        if shapes is not None:
            m, k, n, batch = shapes
            key = (int(m), int(k), int(n), args[-1].element_size())
            self._matmuls[key] = self._matmuls.get(key, 0) + int(batch)
            return
        self._pass_bytes += _tensor_bytes(list(args)) + _tensor_bytes(out)
        self._kernels += 1

    def take(self):
        """The compute since the previous call, as the chip reads it (and reset)."""
        c = {
            "matmuls": [[m, k, n, calls, eb] for (m, k, n, eb), calls in self._matmuls.items()],
            "pass_bytes": self._pass_bytes,
            "kernels": self._kernels,
        }
        self._matmuls = {}
        self._pass_bytes = 0
        self._kernels = 0
        return c
