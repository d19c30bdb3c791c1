"""Meta mode's object collectives and distributed checkpoints.

torch's object collectives (``all_gather_object``, ``gather_object``,
``broadcast_object_list``, ``scatter_object_list``) pickle each object into a byte tensor on
the device, exchange the sizes and then the bytes, and unpickle what arrived. In meta mode the
device holds no bytes, so what arrives is not known (torch's unpickler then fails with
``EOFError``); and one process stands for many ranks, whose objects do not exist. Each call is
replaced:

- on the fabric it is the exchange of sizes torch makes first (one int64 a rank or an object),
  the same on every rank: a verified rank is compared with its representative on the call,
  not on the length of its pickle (an object that holds the rank's number pickles longer on
  rank 1234 than on rank 0);
- its result is the one of ranks alike, as meta mode's collectives of values are: every
  rank's object is a copy of this rank's own;
- a broadcast or scatter from a source that is one of the job's processes (rank 0, a
  representative, a verified rank) carries the source's real pickle to the others through
  the worker (`programs/src/torch/objects.rs`), so `[config] if rank == 0 else [None]`
  gives every process the config; a receiver whose source is a rank its representative
  stands for keeps the list it passed, and the report lists the call and its line.

``torch.distributed.checkpoint``'s ``save``, ``async_save`` and ``load`` write and read
nothing, as ``torch.save`` does not: a meta tensor has no values to write, and a checkpoint's
storage is not modelled. Each is listed with its line. (Left to torch, a save's planning
gathers and scatters pickled plans: the failure above.)

``send_object_list``/``recv_object_list`` are left to torch: pipeline stages send shapes that
way, and docs/TORCH.md says why pipelining does not run in meta mode.
"""

import copy
import functools
import pickle
import struct

import torch
import torch.distributed as dist

META = torch.device("meta")

# Counts a stand-in, `what`, at the program's line (meta mode's list: `podsim._meta`).
_note = None


def _exchange_sizes(collective, count, group, **kwargs):
    """The fabric's part of an object collective: `collective` of `count` int64 sizes."""
    sizes = torch.zeros(count, dtype=torch.int64, device=META)
    if collective == "all_gather":
        out = torch.zeros(count * dist.get_world_size(group), dtype=torch.int64, device=META)
        dist.all_gather_into_tensor(out, sizes, group=group)
    else:
        dist.broadcast(sizes, group=group, **kwargs)


def _alike(obj):
    """Another rank's object, taken to be this rank's own (a copy: the program may change
    either)."""
    try:
        return copy.deepcopy(obj)
    except Exception:  # an object that refuses to copy (a lock, a file): the same object
        return obj


def _source(src, group_src, group):
    """(the source's rank in `group`, whether this rank is it), `src` being a global rank."""
    if group_src is None:
        group_src = dist.get_group_rank(group or dist.group.WORLD, src if src is not None else 0)
    return group_src, dist.get_rank(group) == group_src


def all_gather_object(object_list, obj, group=None, weights_only=False):
    _exchange_sizes("all_gather", 1, group)
    object_list[:] = [_alike(obj) for _ in range(dist.get_world_size(group))]


def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None,
                  weights_only=False):
    _exchange_sizes("all_gather", 1, group)
    _, is_dst = _source(dst, group_dst, group)
    if is_dst and object_gather_list is not None:
        object_gather_list[:] = [_alike(obj) for _ in range(dist.get_world_size(group))]


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None,
                          weights_only=False):
    src_in_group, is_src = _source(src, group_src, group)
    _exchange_sizes("broadcast", len(object_list), group, group_src=src_in_group)
    sent = _handed_over(list(object_list) if is_src else None, src_in_group, group)
    if sent is not None:
        object_list[:] = sent
    elif not is_src:
        _note("broadcast_object_list (kept the list this rank passed)")


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=None,
                        group=None, group_src=None, weights_only=False):
    src_in_group, is_src = _source(src, group_src, group)
    _exchange_sizes("broadcast", 1, group, group_src=src_in_group)
    sent = _handed_over(list(scatter_object_input_list) if is_src else None, src_in_group, group)
    if sent is not None:
        scatter_object_output_list[0] = sent[dist.get_rank(group)]
    else:
        _note("scatter_object_list (kept the list this rank passed)")


# Sourced object calls (broadcasts, scatters) this process has made: the key under which a
# source's pickle is handed over, alike in every process of the job.
_sourced = 0


def _handed_over(sent, src_in_group, group):
    """The source's objects (`sent` when this process is the source, which posts them): a
    copy for the source, the source's pickle for a receiver, `None` when the source is no
    process of the job."""
    from . import torch as backend

    global _sourced
    key, _sourced = _sourced, _sourced + 1
    rank = backend._rank
    if rank is None:
        return None
    with torch._C.DisableTorchFunction():
        if sent is not None:
            data = pickle.dumps(sent)
            framed = struct.pack("<Q", len(data)) + data
            framed += bytes(-len(framed) % 4)
            rank.call({"op": "post_objects", "key": key},
                      torch.frombuffer(bytearray(framed), dtype=torch.uint8).view(torch.float32))
            return pickle.loads(data)
        src = dist.get_global_rank(group or dist.group.WORLD, src_in_group)
        words = rank.call({"op": "fetch_objects", "key": key, "src": src})
        if words is None:
            return None
        raw = words.view(torch.uint8).numpy().tobytes()
        (length,) = struct.unpack_from("<Q", raw)
        return pickle.loads(raw[8:8 + length])


def _skipped(name, result):
    """A stand-in for checkpoint function `name`: nothing written or read, the call listed."""

    def stand_in(*args, **kwargs):
        _note(f"torch.distributed.checkpoint.{name}")
        return result() if callable(result) else result

    stand_in.__name__ = name
    return stand_in


def _done_future():
    from concurrent.futures import Future

    future = Future()
    future.set_result(None)
    return future


REPLACED = {
    "all_gather_object": all_gather_object,
    "gather_object": gather_object,
    "broadcast_object_list": broadcast_object_list,
    "scatter_object_list": scatter_object_list,
}


def install(note):
    """Replaces the calls above; `note(what)` counts a stand-in at the program's line."""
    from torch.distributed import distributed_c10d

    global _note
    _note = note
    for name, replacement in REPLACED.items():
        wrapped = functools.wraps(getattr(distributed_c10d, name))(replacement)
        setattr(distributed_c10d, name, wrapped)
        setattr(dist, name, wrapped)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_loader, state_dict_saver

    for name, result in (("save", None), ("async_save", _done_future), ("load", None)):
        stand_in = _skipped(name, result)
        for module in (dcp, state_dict_saver, state_dict_loader):
            if hasattr(module, name):
                setattr(module, name, stand_in)
