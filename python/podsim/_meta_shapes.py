"""Shapes that depend on data, in meta mode: ``nonzero``, ``torch.where(mask)``,
``x[mask]``, ``masked_select``, ``bincount``.

torch's meta device refuses them (how many elements a mask keeps is data), so a program that
masks its loss (``loss[labels != -100]``) or sends each expert the tokens routed to it
(``torch.where(expert_mask[e])``, as Hugging Face's mixture-of-experts layers do) stopped in
meta mode. Each now gets a stand-in of a defined size, listed in the report with its line:

- a mask that carries a mean (``podsim._meta_counts``: a router's one-hot map, k of E per
  token) keeps that share of its elements, so the experts together get every routed token;
- a tensor of counts (a mean of 1 or more) has every element nonzero;
- any other mask keeps every element, the assumption torch's own fake kernel for ``nonzero``
  makes, which prices the most work the program could do.

``x[mask]`` and ``masked_select`` give a copy of the first rows of ``x`` (gradients flow), the
size the mask keeps; ``x[i]`` with a 0-d meta tensor ``i`` reads ``i``'s stand-in value; ``bincount(x, minlength=n)`` gives ``n`` counts of ``x``'s elements
spread evenly.
"""

import torch

from . import _meta_counts


def kept(mask):
    """How many elements of meta tensor `mask` a stand-in takes as nonzero."""
    n = mask.numel()
    m = _meta_counts.mean_of(mask)
    if m is None or m >= 1:
        return n
    return max(0, min(n, round(m * n)))


def _is_meta_mask(t):
    return isinstance(t, torch.Tensor) and t.is_meta and t.dtype in (torch.bool, torch.uint8)


def _nonzero(args, kwargs):
    t = args[0]
    if not (isinstance(t, torch.Tensor) and t.is_meta):
        return NotImplemented
    rows = torch.zeros(kept(t), t.dim(), dtype=torch.long, device=t.device)
    if kwargs.get("as_tuple"):
        return tuple(rows.unbind(1)) if t.dim() else (rows.view(-1),)
    return rows


def _where(args, kwargs):
    if len(args) != 1 or kwargs:  # `where(cond, x, y)` has no data-dependent shape
        return NotImplemented
    return _nonzero(args, {"as_tuple": True})


def _rows(x, mask):
    """The first rows of `x` that a boolean `mask` over its leading dimensions keeps."""
    k = mask.dim()
    if tuple(mask.shape) != tuple(x.shape[:k]):
        return NotImplemented
    # A copy, as torch's gather is: writing to it leaves `x` alone.
    return x.reshape(-1, *x.shape[k:]).narrow(0, 0, kept(mask)).clone()


def _getitem(args, kwargs):
    x, index = args[0], args[1]
    if _is_meta_mask(index):
        return _rows(x, index)
    if isinstance(index, torch.Tensor) and index.is_meta and index.dim() == 0:
        # A 0-d index (a row of `nonzero`'s result) torch would read with `.item()` in C++,
        # where meta mode's stand-in cannot answer: read here, where it can (the value's
        # stand-in is listed; the size is not one).
        i, n = int(index), x.shape[0] if x.dim() else 0
        return Read(x[min(max(i, -n), n - 1)] if n else x[i])
    return NotImplemented


class Read:
    """A result whose size is not a stand-in (only a value read on the way was)."""

    def __init__(self, out):
        self.out = out


def _masked_select(args, kwargs):
    x, mask = args[0], args[1] if len(args) > 1 else kwargs.get("mask")
    if not _is_meta_mask(mask):
        return NotImplemented
    shape = torch.broadcast_shapes(x.shape, mask.shape)
    return _rows(x.expand(shape).reshape(-1), mask.expand(shape).reshape(-1))


def _bincount(args, kwargs):
    x = args[0]
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    if not (isinstance(x, torch.Tensor) and x.is_meta) or not minlength:
        return NotImplemented  # a length that is the largest value: no size to stand in
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    dtype = weights.dtype if weights is not None else torch.long
    counts = torch.zeros(minlength, dtype=dtype, device=x.device)
    if weights is None:
        setattr(counts, "_podsim_mean", x.numel() / minlength)
    return counts


def _functions():
    T = torch.Tensor
    table = {torch.nonzero: _nonzero, T.nonzero: _nonzero, torch.argwhere: _nonzero,
             T.argwhere: _nonzero, torch.where: _where, T.__getitem__: _getitem,
             torch.masked_select: _masked_select, T.masked_select: _masked_select,
             torch.bincount: _bincount, T.bincount: _bincount}
    return table


FUNCTIONS = _functions()


def stand_in(func, args, kwargs):
    """`func(*args, **kwargs)` with a stand-in size, or NotImplemented when its shape does
    not depend on data here (torch runs it)."""
    return FUNCTIONS[func](args, kwargs)
