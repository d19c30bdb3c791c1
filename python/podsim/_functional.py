"""Torch's functional collectives on meta tensors: tensor parallelism's communication.

DTensor (tensor and sequence parallelism, ``redistribute``) communicates through
``torch.ops._c10d_functional``. On real tensors their kernels call the rank's process group,
podsim's; on meta tensors torch's kernels only shape the output, so in meta mode tensor
parallelism would cost nothing on the chip's clock. The kernels registered here for the meta
device run each collective on its group through ``torch.distributed`` (sizes only, as every
meta-mode collective), asynchronously like the real ones: ``wait_tensor`` (which DTensor
calls before a result is used) waits for it, so the chip overlaps it with compute until then.
"""

import torch.distributed as dist
# Registers torch's own kernels first, which `install` then replaces for the meta device
# through the same registration handle torch keeps for the namespace (`lib_impl`).
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}

# Collectives in flight, by the id of their output tensor, until `wait_tensor` meets it.
_in_flight = {}

_installed = False


def _group(name):
    return c10d._resolve_process_group(name)


def _reduce_op(name):
    try:
        return _REDUCE_OPS[name.lower()]
    except KeyError:
        raise NotImplementedError(f"podsim: functional collective with reduce op {name!r}") from None


def _issued(out, work):
    if work is not None:
        _in_flight[id(out)] = (out, work)
    return out


def all_gather_into_tensor(inp, group_size, group_name):
    out = inp.new_empty((inp.shape[0] * group_size, *inp.shape[1:]))
    work = dist.all_gather_into_tensor(out, inp.contiguous(), group=_group(group_name),
                                       async_op=True)
    return _issued(out, work)


def reduce_scatter_tensor(inp, reduce_op, group_size, group_name):
    out = inp.new_empty((inp.shape[0] // group_size, *inp.shape[1:]))
    work = dist.reduce_scatter_tensor(out, inp.contiguous(), op=_reduce_op(reduce_op),
                                      group=_group(group_name), async_op=True)
    return _issued(out, work)


def all_reduce(inp, reduce_op, group_name):
    out = inp.clone()
    work = dist.all_reduce(out, op=_reduce_op(reduce_op), group=_group(group_name),
                           async_op=True)
    return _issued(out, work)


def all_to_all_single(inp, output_split_sizes, input_split_sizes, group_name):
    rows = sum(output_split_sizes) if output_split_sizes else inp.shape[0]
    out = inp.new_empty((rows, *inp.shape[1:]))
    work = dist.all_to_all_single(out, inp.contiguous(), output_split_sizes or None,
                                  input_split_sizes or None, group=_group(group_name),
                                  async_op=True)
    return _issued(out, work)


def wait_tensor(t):
    pending = _in_flight.pop(id(t), None)
    if pending is not None and pending[0] is t:
        pending[1].wait()
    return t


def install():
    """Registers the meta-device kernels (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    for kernel in (all_gather_into_tensor, reduce_scatter_tensor, all_reduce, all_to_all_single,
                   wait_tensor):
        funcol.lib_impl.impl(kernel.__name__, kernel, "Meta")
