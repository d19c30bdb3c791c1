"""Balanced counts in meta mode: sizes a program reads from data it cannot see.

A mixture of experts routes each token to its top-k experts, counts the tokens each expert
got (``routing_map.sum(...)``, ``histc``), exchanges the counts with an all-to-all, and reads
them back (``.tolist()``) as the split sizes of the all-to-all that moves the tokens. In meta
mode the router's choice is not computed, so stand-in ones would cut splits that do not add
up to the tokens (torch refuses them) or price the experts on a handful of rows.

Here an integer or boolean tensor derived from such data carries the value every element has
on average (``_podsim_mean``), from where it is known: all zeros, then ``scatter_`` of k
values per row of E (k / E each), a histogram of n values in b bins (n / b each), sums over
dimensions, views, moves and collectives (every rank alike, as meta mode's ranks are). What
reads its values gets them spread evenly with the exact total (``round(mean * numel)``):
balanced routing, the load a capacity plan assumes, listed in the report as a stand-in.

A small tensor of real values moved to the device (a flag every rank votes with,
``torch.tensor([ok], device="cuda")`` then ``all_reduce(MIN)`` and ``.item()``, as torch's
pipelining decides how its stages agree on shapes) keeps them beside it (``_podsim_values``):
they follow reshapes and podsim's collectives (every rank holding the same), and are what a
read gives, in place of a stand-in.
"""

import torch
import torch.nn.functional as F

_MEAN = "_podsim_mean"
_VALUES = "_podsim_values"

# The most elements a tensor moved to the device keeps its values for (flags, small counts).
KNOWN_VALUES = 4096


def values_of(t):
    """The real values meta tensor `t` is known to hold, or None."""
    return getattr(t, _VALUES, None) if isinstance(t, torch.Tensor) else None


def keep_values(t, real):
    """Meta tensor `t` was made from real tensor `real` (moved to the device): small ones
    keep their values beside it."""
    if isinstance(real, torch.Tensor) and not real.is_meta and real.numel() <= KNOWN_VALUES:
        with torch._C.DisableTorchFunction():
            setattr(t, _VALUES, real.detach().to("cpu", t.dtype).reshape(t.shape).clone())


def mean_of(t):
    """The mean value carried by tensor `t`, or None."""
    return getattr(t, _MEAN, None) if isinstance(t, torch.Tensor) else None


def _set(t, mean):
    if isinstance(t, torch.Tensor) and mean is not None:
        setattr(t, _MEAN, float(mean))


def _counting(t):
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()


def _filled(value):
    def rule(func, args, kwargs, out):
        if _counting(out):
            _set(out, value)

    return rule


def _full(func, args, kwargs, out):
    """`full(size, v)`, `full_like(t, v)`, `new_full(size, v)`: the fill value second."""
    value = args[1] if len(args) > 1 else kwargs.get("fill_value")
    if _counting(out) and isinstance(value, (bool, int, float)):
        _set(out, value)


def _scatter(func, args, kwargs, out):
    """`self.scatter_(dim, index, value | src)`: k written values a row of E, distinct (a
    top-k's experts), over the row's mean."""
    self, dim, index = args[0], args[1], args[2]
    m = mean_of(self)
    value = args[3] if len(args) > 3 else kwargs.get("value", kwargs.get("src"))
    v = mean_of(value) if isinstance(value, torch.Tensor) else value
    if m is None or v is None or isinstance(v, complex):
        forget(out)
        return
    share = index.shape[dim] / max(self.shape[dim], 1)
    accumulate = func.__name__.startswith("scatter_add")
    _set(out, m + v * share if accumulate else m + (float(v) - m) * share)


def forget(t):
    for attribute in (_MEAN, _VALUES):
        if hasattr(t, attribute):
            delattr(t, attribute)


def _added(func, args, kwargs, out):
    """`a + b` (or `a += b`, `a.add_(b)`): the means add; values are not followed."""
    a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other")
    ma = mean_of(a)
    mb = mean_of(b) if isinstance(b, torch.Tensor) else b
    alpha = kwargs.get("alpha", 1)
    if isinstance(mb, (int, float)) and isinstance(alpha, (int, float)):
        mb = mb * alpha
    in_place = out is a
    if in_place:
        forget(out)
    if ma is not None and isinstance(mb, (int, float)) and not isinstance(mb, bool):
        _set(out, ma + mb)


def _histc(func, args, kwargs, out):
    bins = args[1] if len(args) > 1 else kwargs.get("bins", 100)
    _set(out, args[0].numel() / max(bins, 1))


def _one_hot(func, args, kwargs, out):
    if out.shape[-1]:
        _set(out, 1.0 / out.shape[-1])


def _summed(func, args, kwargs, out):
    m = mean_of(args[0])
    if m is not None and out.numel():
        _set(out, m * args[0].numel() / out.numel())


def _same(func, args, kwargs, out):
    values = values_of(args[0])
    if values is not None and func.__name__ in _RESHAPES and isinstance(out, torch.Tensor):
        if out.numel() == values.numel():
            keep_values(out, values.to(out.dtype))
    m = mean_of(args[0])
    if m is None:
        return
    for t in out if isinstance(out, (list, tuple)) else (out,):
        _set(t, m)


# Ops after which the values, in order, are the same ones in another shape or dtype.
_RESHAPES = {"view", "reshape", "flatten", "contiguous", "clone", "to", "cpu", "long", "int",
             "detach", "unsqueeze", "squeeze", "view_as", "reshape_as"}


def _joined(func, args, kwargs, out):
    parts = args[0]
    means = [mean_of(p) for p in parts]
    if parts and None not in means:
        total = sum(p.numel() for p in parts)
        _set(out, sum(m * p.numel() for m, p in zip(means, parts)) / max(total, 1))


_COMPARE = {"gt": lambda a, b: a > b, "ge": lambda a, b: a >= b, "lt": lambda a, b: a < b,
            "le": lambda a, b: a <= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b}


def _compared(func, args, kwargs, out):
    """`x > c` (and the other comparisons with a number): counts (a mean of 1 or more, every
    element alike when balanced) compare as their mean does; a mask (a share of ones) keeps
    its share where the comparison picks its ones, the rest where it picks its zeros."""
    m, c = mean_of(args[0]), args[1] if len(args) > 1 else None
    name = func.__name__.strip("_").replace("greater_equal", "ge").replace("greater", "gt")
    name = name.replace("less_equal", "le").replace("less", "lt").replace("not_equal", "ne")
    op = _COMPARE.get(name)
    if m is None or op is None or not isinstance(c, (bool, int, float)):
        return
    if not 0 < m < 1:  # counts (or a constant): every element is its mean
        _set(out, 1.0 if op(m, c) else 0.0)
    elif op(1, c) != op(0, c):  # a mask's share of ones, told from its zeros
        _set(out, m if op(1, c) else 1.0 - m)


def _rules():
    T = torch.Tensor
    same = (T.view, T.reshape, torch.reshape, T.flatten, torch.flatten, T.contiguous, T.clone,
            torch.clone, T.to, T.cpu, T.long, T.int, T.detach, T.unsqueeze, T.squeeze,
            T.permute, T.transpose, T.t, T.split, torch.split, T.chunk, torch.chunk, T.unbind,
            torch.unbind, T.expand, T.view_as, T.reshape_as, T.__getitem__, T.select,
            torch.select, T.narrow, torch.narrow)
    rules = {f: _same for f in same}
    rules.update({f: _filled(0.0) for f in (torch.zeros, torch.zeros_like, T.new_zeros)})
    rules.update({f: _filled(1.0) for f in (torch.ones, torch.ones_like, T.new_ones)})
    rules.update({f: _full for f in (torch.full, torch.full_like, T.new_full)})
    rules.update({f: _scatter for f in (T.scatter_, T.scatter, torch.scatter, T.scatter_add_,
                                        T.scatter_add, torch.scatter_add)})
    rules.update({f: _histc for f in (torch.histc, T.histc)})
    rules.update({f: _summed for f in (torch.sum, T.sum)})
    rules.update({f: _joined for f in (torch.cat, torch.concat, torch.stack)})
    rules[F.one_hot] = _one_hot
    for f in (torch.add, T.add, T.add_, T.__add__, T.__radd__, T.__iadd__):
        rules[f] = _added
    for name in _COMPARE:
        for f in (getattr(torch, name), getattr(T, name), getattr(T, f"__{name}__")):
            rules[f] = _compared
    for f in (torch.greater, torch.greater_equal, torch.less, torch.less_equal,
              torch.not_equal):
        rules[f] = _compared
    return rules


RULES = _rules()


def _outside_torch(func):
    """Whether `func` is a framework's own function, not one of torch's (whose results a
    rule above describes, or whose values differ from their arguments': `cumsum`, `* 2`)."""
    module = getattr(func, "__module__", None)
    return isinstance(module, str) and module.split(".")[0] != "torch"


def carry(func, args, kwargs, out):
    """After `func(*args, **kwargs)` gave `out` in meta mode: the mean its result carries.
    A function without a rule (a framework's own collective, whose inside runs with meta
    mode's function mode off) that gives an integer tensor of as many elements as one
    tracked argument, and of its dtype, moved or permuted those counts: the same mean (a
    comparison, of another dtype, is not counts). A tensor written in place or through
    `out=` forgets what it held first."""
    written = kwargs.get("out")
    if isinstance(written, torch.Tensor):
        forget(written)
    rule = RULES.get(func)
    try:
        if rule is not None:
            rule(func, args, kwargs, out)
        elif getattr(func, "__name__", "").endswith("_") and out is (args[0] if args else None):
            forget(out)  # written in place by an op without a rule: what it held is gone
        elif _counting(out) and mean_of(out) is None and _outside_torch(func):
            means = {mean_of(a) for a in args if mean_of(a) is not None
                     and a.numel() == out.numel() and a.dtype == out.dtype}
            if len(means) == 1:
                _set(out, means.pop())
    except Exception:  # a mean is a hint: never a reason for the program to fail
        pass


def carry_collective(outs, ins, factor=1):
    """A collective of podsim's backend moved `ins` into `outs` (lists, position for
    position, or one input for every output): every rank holds the same means and values,
    so each output has its input's, times `factor` for a sum over the ranks (None: a
    reduction whose result is not known)."""
    try:
        _carry_collective(outs, ins, factor)
    except Exception:  # a hint: never a reason for the collective to fail
        pass


def _carry_collective(outs, ins, factor):
    # Read before anything is forgotten: an all-reduce's output is its input.
    known = [(mean_of(s), values_of(s)) for s in (ins if len(ins) == len(outs) else ins[:1])]
    for i, o in enumerate(outs):
        forget(o)
        if factor is None:
            continue
        m, values = known[i] if len(known) == len(outs) else known[0]
        if m is not None:
            _set(o, m * factor)
        if values is not None and values.numel() == o.numel():
            keep_values(o, values * factor if factor != 1 else values)


def balanced(t):
    """`t`'s known values, or its values spread evenly with its mean's total, as a real
    tensor; None when `t` carries neither."""
    values = values_of(t)
    if values is not None:
        return values.clone()
    m = mean_of(t)
    if m is None:
        return None
    n = t.numel()
    total = round(m * n)
    base, extra = divmod(total, n) if n else (0, 0)
    with torch._C.DisableTorchFunction():
        values = torch.full((n,), base, dtype=torch.int64)
        values[:extra] += 1
        return values.view(t.shape).to(t.dtype)
