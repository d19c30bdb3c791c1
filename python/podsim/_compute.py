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

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch without DTensor
    _DTensor = None

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
        return x.nbytes
    if isinstance(x, (list, tuple)):
        return sum(y.nbytes for y in x if isinstance(y, torch.Tensor))
    return 0


# What each op is, decided once per op overload: 0 costs nothing, 1 is a matrix product,
# 2 a pass over its tensors.
_FREE_KIND, _MATMUL_KIND, _PASS_KIND = 0, 1, 2
_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}


def _kind_of(func):
    packet = func.overloadpacket
    if packet in _FREE or getattr(func, "is_view", False):
        return _FREE_KIND
    return _MATMUL_KIND if packet in _MATMULS else _PASS_KIND


class Compute(TorchDispatchMode):
    """A dispatch mode accumulating the compute of every op since the last `take()`."""

    def __init__(self):
        super().__init__()
        self._matmuls = {}
        self._pass_bytes = 0
        self._kernels = 0
        self._kinds = {}
        # Attention kernels: (batch, seq, heads, head_dim, causal, backward, elem_bytes) ->
        # calls.
        self._attention = {}
        # Set while podsim itself moves tensors (a collective's copies are not compute).
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in types:
            if t is not torch.Tensor and t is not torch.nn.Parameter:
                if _DTensor is not None and issubclass(t, _DTensor):
                    # DTensor's dispatch runs the local ops, which come back here and are
                    # counted on the shapes that really run on this chip.
                    return NotImplemented
                # Other subclasses (fake tensors of sharding propagation, functional
                # wrappers) run nothing on the chip: not counted.
                return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind_of(func)
        if kind == _FREE_KIND:
            return out
        try:
            if kind == _MATMUL_KIND:
                m, k, n, batch = _matmul_shapes(func.overloadpacket, args)
                key = (int(m), int(k), int(n), args[-1].element_size())
                self._matmuls[key] = self._matmuls.get(key, 0) + int(batch)
            else:
                self._pass_bytes += _tensor_bytes(out)
                for a in args:
                    self._pass_bytes += _tensor_bytes(a)
                self._kernels += 1
        except Exception:  # counting must never break the user's program
            pass
        return out

    def take(self):
        """The compute since the previous call, as the chip reads it (and reset)."""
        c = {
            "matmuls": [[m, k, n, calls, eb] for (m, k, n, eb), calls in self._matmuls.items()],
            "pass_bytes": self._pass_bytes,
            "kernels": self._kernels,
            "attention": [[*key, calls] for key, calls in self._attention.items()],
        }
        self._attention = {}
        self._matmuls = {}
        self._pass_bytes = 0
        self._kernels = 0
        return c

    def add_attention(self, q, k, causal, backward):
        """One attention kernel on `q` `(batch, heads, seq, head_dim)` against `k`, priced as
        flash attention (the chip's kernel), not as the decomposition torch runs here."""
        if self.paused:
            return
        *lead, heads, seq, head_dim = q.shape
        batch = 1
        for d in lead:
            batch *= int(d)
        key = (batch, int(max(seq, k.shape[-2])), int(heads), int(head_dim), int(bool(causal)),
               int(bool(backward)), q.element_size())
        self._attention[key] = self._attention.get(key, 0) + 1


def price_attention_as_flash(compute):
    """`F.scaled_dot_product_attention` counted as one flash-attention kernel forward and one
    backward, whatever torch decomposes it into on this host (the CPU's kernel, or on the
    meta device the math path with its full score matrix, which no TPU materialises). The
    backward recomputes the forward, as flash attention does, so nothing is kept but q, k, v;
    with dropout the values would differ on recomputation, so such calls are counted as they
    run."""
    F = torch.nn.functional
    sdpa = F.scaled_dot_product_attention

    class FlashAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, kwargs):
            compute.add_attention(q, k, kwargs.get("is_causal", False), backward=False)
            ctx.kwargs = kwargs
            ctx.save_for_backward(q, k, v)
            was, compute.paused = compute.paused, True
            try:
                return sdpa(q, k, v, **kwargs)
            finally:
                compute.paused = was

        @staticmethod
        def backward(ctx, grad):
            q, k, v = ctx.saved_tensors
            compute.add_attention(q, k, ctx.kwargs.get("is_causal", False), backward=True)
            was, compute.paused = compute.paused, True
            try:
                with torch.enable_grad():
                    inputs = [x.detach().requires_grad_(True) for x in (q, k, v)]
                    out = sdpa(*inputs, **ctx.kwargs)
                    grads = torch.autograd.grad(out, inputs, grad)
            finally:
                compute.paused = was
            return (*grads, None)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                     is_causal=False, scale=None, enable_gqa=False):
        kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal,
                  "scale": scale, "enable_gqa": enable_gqa}
        plain = all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in (query, key, value))
        if dropout_p or not plain or attn_mask is not None and attn_mask.requires_grad:
            return sdpa(query, key, value, **kwargs)
        if not torch.is_grad_enabled() or not any(x.requires_grad for x in (query, key, value)):
            compute.add_attention(query, key, is_causal, backward=False)
            was, compute.paused = compute.paused, True
            try:
                return sdpa(query, key, value, **kwargs)
            finally:
                compute.paused = was
        return FlashAttention.apply(query, key, value, kwargs)

    F.scaled_dot_product_attention = scaled_dot_product_attention
