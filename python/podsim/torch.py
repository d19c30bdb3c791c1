"""The ``podsim`` torch.distributed backend.

Importing this module registers the backend; under ``podsim run`` a program then calls
``dist.init_process_group("podsim")`` as it would with gloo. Each rank is one emulated chip:
its collectives run on podsim's fabric and algorithms (``programs/src/torch/``), under the
chip's virtual clock, flight recorder, fault hooks and desync checks, and the compute the
rank runs between collectives is counted at torch's dispatcher and charged to the modelled
hardware. ``step()`` marks the end of a training step for the per-step report.

Values travel as float32: 16-bit floats are widened for reductions (and rounded back), so a
bf16 sum is rounded once, not at every hop. Collectives that only move data (all-gather,
all-to-all, broadcast of non-float32 tensors, send and recv) move raw bytes and are exact for
every dtype; a broadcast is priced as the broadcast of its bytes.
Reductions podsim's chips do not do (product, bitwise ops, integer sums) gather the inputs and
reduce them on the rank, in rank order: in data mode they are charged as the all-gather they
are; in meta mode (sizes only) as the reduction of their bytes a TPU runs.
"""

import atexit
import faulthandler
import math
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.distributed as dist

from . import _meta_counts, _saved, _streams
from ._compute import Compute, Memory, price_attention_as_flash, recomputation_apart
from ._replay import Steps, signature
from ._wire import Connection, PodsimError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["step", "torus_mesh", "PodsimError", "ProcessGroupPodsim"]

BACKEND = "podsim"
# How often the sampler reports where the rank is while it is outside podsim calls.
_STACK_EVERY_S = 0.2


class _Rank:
    """This process's link to its chip: the connection, the compute counter, the sampler."""

    def __init__(self):
        try:
            socket_name = os.environ["PODSIM_SOCKET"]
        except KeyError:
            raise PodsimError(
                "podsim: PODSIM_SOCKET is not set: start the program with "
                "`podsim run --topology SHAPE -- python script.py` (or a kind = \"torch\" job)"
            ) from None
        # Nothing to ask the kernel here: the worker gave this process SIGKILL as its
        # parent-death signal, and a process group of its own, before it ran anything
        # (links/src/procs.rs), so the rank and what it starts die with the job.
        self.rank = int(os.environ["RANK"])
        self.conn = Connection(socket_name, self.rank, os.environ.get("PODSIM_TOKEN", ""))
        self.eager = os.environ.get("PODSIM_EAGER", "fused")
        self.compute = Compute(self.eager)
        self.steps = None
        if os.environ.get("PODSIM_COUNT_COMPUTE", "1") != "0":
            device_type = "meta" if os.environ.get("PODSIM_MODE") == "meta" else "cpu"
            capacity = float(os.environ.get("PODSIM_HBM_BYTES", "0"))
            hardware = os.environ.get("PODSIM_HARDWARE", "modelled")
            self.compute.host_ops_free = device_type == "meta"
            self.compute.memory = Memory(device_type, capacity, hardware)
            _storage_resizes_reach(self.compute.memory)
            _saved.install(self.compute)
            self.compute.__enter__()
            price_attention_as_flash(self.compute)
            recomputation_apart(self.compute)
            # Steady steps are counted once and replayed (`podsim._replay`).
            replay = os.environ.get("PODSIM_COUNT", "steady") == "steady"
            self.steps = Steps(self.compute, replay)
        self.in_call = 0
        self.next_group = 0
        self.done = False
        # Meta mode: tensors have no values; collectives move sizes (`podsim._meta`).
        self.meta = os.environ.get("PODSIM_MODE") == "meta"
        # Whether the program marks its own steps (then `optimizer.step()` does not).
        self.explicit_steps = False
        # Collectives get ids (their works); the compute stream's waits for them travel with
        # the next request, each after the compute run before it (`podsim._streams`).
        self.next_work = 0
        self.pending_waits = []
        self.clock_ns = 0.0
        threading.Thread(target=self._sample, name="podsim-stack", daemon=True).start()
        atexit.register(self.bye)

    def call(self, request, payload=None, out=None):
        """One request to the chip, with the compute run since the previous one."""
        if self.done:
            raise PodsimError("podsim: the process group was shut down")
        self.in_call += 1
        was, self.compute.paused = self.compute.paused, True
        try:
            if self.pending_waits:
                request["waits"], self.pending_waits = self.pending_waits, []
            self._add_compute(request, payload)
            request["site"] = _call_site()
            reply, values = self.conn.call(request, payload, out)
            self.clock_ns = reply.get("clock_ns", self.clock_ns)
            return values
        finally:
            self.compute.paused = was
            self.in_call -= 1

    def _take(self, sig):
        """The compute run since the previous request (of signature `sig` under replay)."""
        return self.compute.take() if self.steps is None else self.steps.take(sig)

    def _add_compute(self, request, payload):
        """The compute run since the previous request, counted or replayed; at a step's end
        also the step's HBM peak and how its compute was known."""
        if request["op"] == "step":
            self.compute.end_kernels()
        sig = signature(request, payload) if self.steps is not None else None
        if self.steps is None or request["op"] != "step":
            request["compute"] = self._take(sig)
            return
        memory = self.compute.memory
        request["compute"], request["hbm"], request["counting"] = self.steps.end_step(
            sig, memory.take_step()
        )
        memory.replayed(request["hbm"]["peak_bytes"])

    @staticmethod
    def step_request(auto=False):
        """The end of a step (`auto`: marked by `optimizer.step()`)."""
        return {"op": "step", "auto": auto}

    def wait_for(self, works):
        """The compute stream waits here for collectives `works` (sent with the next
        request, after the compute run so far)."""
        compute = self._take(("wait", len(works)))
        self.pending_waits.append({"compute": compute, "works": list(works)})

    def bye(self):
        if not self.done:
            try:
                self.call({"op": "bye", "stand_ins": _stand_ins()})
            except Exception:
                pass
            self.done = True
            self.conn.close()

    def _sample(self):
        main = threading.main_thread().ident
        # The chip asks the kernel whether any thread of the rank is running to tell a rank
        # that works from one that sleeps; this thread, waking to sample, is not the rank's
        # work (on a busy host it waits for a core at every wake).
        try:
            self.conn.send({"op": "sampler", "thread": threading.get_native_id()})
        except Exception:
            return
        last = None
        while not self.done:
            time.sleep(_STACK_EVERY_S)
            if self.in_call:
                continue
            frames = _stack_of(main)
            if frames is None:
                return
            if frames != last:
                try:
                    self.conn.send({"op": "stack", "frames": frames})
                except Exception:
                    return
                last = frames


# Where the sampler has faulthandler write the threads' stacks (a file in memory: a write
# there never blocks, as one to a full pipe would with the GIL held).
_STACKS_FD = None


def _stack_of(thread):
    """Thread `thread`'s stack, outermost call first, as `file:line function` (None once it
    has ended). faulthandler writes it in C without letting another thread run and without
    making a frame object: a frame object the sampler held while the program returned from
    its function would keep that function's tensors alive, and so change the HBM and fused
    kernels the program is charged (virtual times that differ between runs)."""
    global _STACKS_FD
    if _STACKS_FD is None:
        _STACKS_FD = os.memfd_create("podsim-stacks", os.MFD_CLOEXEC)
    os.ftruncate(_STACKS_FD, 0)
    os.lseek(_STACKS_FD, 0, os.SEEK_SET)
    faulthandler.dump_traceback(_STACKS_FD, all_threads=True)
    os.lseek(_STACKS_FD, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(_STACKS_FD, 1 << 16):
        chunks.append(chunk)
    return parse_thread_stack(b"".join(chunks).decode("utf-8", "replace"), thread)


def parse_thread_stack(text, thread):
    """Thread `thread`'s frames from faulthandler's dump of every thread, outermost first;
    None when the dump has no such thread."""
    header = f"0x{thread:016x}"
    frames, found, inside = [], False, False
    for line in text.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            inside = header in line.split(" (", 1)[0]
            found = found or inside
        elif inside and line.startswith('  File "') and '", line ' in line:
            path, rest = line[len('  File "'):].split('", line ', 1)
            lineno, _, name = rest.partition(" in ")
            frames.append(f"{path}:{lineno} {name}")
    return frames[::-1] if found else None


_rank = None


def _storage_resizes_reach(memory):
    """In-place storage resizes (how FSDP2 frees and refills unsharded parameters) reach the
    HBM count; they are no tensor op, so the dispatcher does not see them."""
    resize = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = resize(storage, size)
        memory.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_


def _connect():
    global _rank
    if _rank is None:
        _rank = _Rank()
    return _rank


_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


def is_library_file(path: str) -> bool:
    """Whether `path` is torch's or podsim's own code, not the program's."""
    return path.startswith(_LIBRARY_DIRS) or path.startswith("<frozen")


def _call_site():
    """`file:line function` of the innermost frame outside torch and podsim."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not is_library_file(path):
            return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def _stand_ins():
    """Meta mode's stand-in values given so far: `[what, where, count]`."""
    meta = sys.modules.get("podsim._meta")
    if meta is None:
        return []
    return [[what, where, n] for (what, where), n in meta.stand_ins.items()]


def step() -> None:
    """Marks the end of a training step: the report gives each step's compute, communication
    and exposed communication in virtual time (and step-based faults fire here). A program
    that never calls it has a step at each `optimizer.step()` (under `podsim run`)."""
    rank = _connect()
    rank.explicit_steps = True
    _streams.wait_all()
    rank.call(rank.step_request())


def torus_mesh(names: Optional[Sequence[str]] = None) -> "DeviceMesh":
    """A device mesh shaped like the emulated pod, one mesh dimension per torus axis
    (outermost first: `dcn` when there are several slices, then `z, y, x`), so that each
    dimension's groups are torus rings (or the DCN links between slices)."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = [int(d) for d in os.environ["PODSIM_TOPOLOGY"].split("x")]
    shape = list(reversed(dims))
    default = list(reversed(["x", "y", "z"][: len(dims)]))
    slices = dist.get_world_size() // max(1, math.prod(dims))
    if slices > 1:  # slices joined by DCN: the outermost dimension
        shape.insert(0, slices)
        default.insert(0, "dcn")
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names or default))



# ---- values on the wire -------------------------------------------------------------------

_FLOAT_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_REDUCE_NAMES = [
    (dist.ReduceOp.SUM, "sum"),
    (dist.ReduceOp.AVG, "avg"),
    (dist.ReduceOp.MAX, "max"),
    (dist.ReduceOp.MIN, "min"),
]


def _reduce_name(op):
    """podsim's name of a reduce op its chips do, or None (a `ReduceOp` compares equal to its
    kind but does not hash like it)."""
    return next((name for kind, name in _REDUCE_NAMES if op == kind), None)


def _as_f32(t):
    """A flat, contiguous float32 copy (or view) of a float tensor's values."""
    return t.detach().reshape(-1).to(torch.float32).contiguous()


def _as_words(t):
    """A tensor's raw bytes as float32 words (padded to a whole word): moved, never added."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = (-raw.numel()) % 4
    if pad:
        raw = torch.cat([raw, raw.new_zeros(pad)])
    return raw.view(torch.float32)


def _from_words(words, like, nbytes=None):
    """`like`-shaped values from float32 words holding raw bytes."""
    raw = words.view(torch.uint8)[: nbytes if nbytes is not None else like.numel() * like.element_size()]
    return raw.view(like.dtype).reshape(like.shape)


def _alike_ranks_factor(op, ranks):
    """What a reduction over `ranks` ranks holding the same values multiplies them by: the
    rank count for a sum, 1 for a mean, maximum or minimum; None for any other (its result
    is not known)."""
    if op == dist.ReduceOp.SUM:
        return ranks
    # `op == kind` (a `ReduceOp` against a kind), which `in` would not ask.
    if any(op == kind for kind in (dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN)):
        return 1
    return None


def _premultiplied(op):
    """`ReduceOp.PREMUL_SUM(f)` (FSDP2's gradient division when a program sets its own
    factor) is a sum of inputs multiplied by `f` first, as NCCL runs it: (SUM, f). Any
    other op: (op, None)."""
    if op == dist.ReduceOp.PREMUL_SUM:
        return dist.ReduceOp.SUM, op.factor
    return op, None


def _scaled(t, factor):
    return t if factor is None else t * factor


def _reduce_locally(stacked, op):
    """The reduction podsim's chips do not do, over gathered inputs (rank order)."""
    if op == dist.ReduceOp.SUM:
        return stacked.sum(0, dtype=stacked.dtype)
    if op == dist.ReduceOp.PRODUCT:
        return stacked.prod(0, dtype=stacked.dtype)
    if op == dist.ReduceOp.MAX:
        return stacked.amax(0)
    if op == dist.ReduceOp.MIN:
        return stacked.amin(0)
    if op == dist.ReduceOp.AVG:
        return stacked.sum(0) / stacked.shape[0]
    bitwise = {dist.ReduceOp.BAND: torch.bitwise_and, dist.ReduceOp.BOR: torch.bitwise_or,
               dist.ReduceOp.BXOR: torch.bitwise_xor}
    if op in bitwise:
        out = stacked[0].clone()
        for x in stacked[1:]:
            out = bitwise[op](out, x)
        return out
    raise PodsimError(f"podsim: reduce op {op} is not supported")


class _Done(dist._Work):
    """A collective whose values are final when the call returns (podsim moves them at
    once), while on the chip's clock it runs from its issue on a communication stream: the
    compute stream waits for it at `wait()` (see `podsim._streams`)."""

    def __init__(self, result=None, works=()):
        super().__init__()
        self._result = result if result is not None else []
        self._works = works
        self._future = torch.futures.Future()
        self._future.set_result(self._result)

    def wait(self, timeout=None):
        for work in self._works:
            _streams.waited(work)
        return True

    def get_future(self):
        return self._future

    def is_completed(self):
        return True

    def is_success(self):
        return True

    def result(self):
        return self._result


class _Recv(dist._Work):
    """A receive, done when it is waited on: `dist.recv` waits at once; an `irecv` (alone or
    in `batch_isend_irecv`) lets the rank post its sends first, so that ranks that receive
    before they send in program order do not wait on each other. The message waits in the
    chip's inbox meanwhile; virtual time counts its arrival, not the wait. Asking for its
    future receives too (gloo's receives have no future at all); asking whether it completed
    does not, as with gloo: a poll must never block."""

    def __init__(self, node, tensors, peer, tag):
        super().__init__()
        self._node, self._tensors, self._peer, self._tag = node, tensors, peer, tag
        self._future = torch.futures.Future()
        self._done = False

    def wait(self, timeout=None):
        if not self._done:
            self._done = True
            for t in self._tensors:
                count = (t.numel() * t.element_size() + 3) // 4
                words = self._node.call(
                    {"op": "recv", "peer": self._peer, "tag": self._tag, "count": count}
                )
                if t.is_meta:
                    continue  # a size moved; there are no values to copy
                t.copy_(_from_words(words, t))
            self._future.set_result(self._tensors)
        return True

    def get_future(self):
        self.wait()
        return self._future

    def is_completed(self):
        return self._done

    def is_success(self):
        return self._done

    def result(self):
        self.wait()
        return self._tensors


def rank_runs(ranks):
    """`ranks` (sorted) as runs `[first, count, stride]`, as the chip reads a group: the world
    group is one run and a device mesh's groups a few, where a list of every rank outgrew a
    frame at 262,144 ranks."""
    runs = []
    i = 0
    while i < len(ranks):
        first = ranks[i]
        stride = ranks[i + 1] - first if i + 1 < len(ranks) else 1
        count = 1
        while i + count < len(ranks) and ranks[i + count] == first + count * stride:
            count += 1
        runs.append([first, count, stride])
        i += count
    return runs


class ProcessGroupPodsim(dist.ProcessGroup):
    """A group of ranks whose collectives run on their emulated chips."""

    def __init__(self, rank, size, ranks, name=None):
        super().__init__(rank, size)
        # A ProcessGroup keeps its name in its backends; this one is its own backend, so it
        # keeps them here (functional collectives, DTensor and FSDP2 find groups by name).
        self._name = name or ""
        self._desc = ""
        self._node = _connect()
        self._call_works = []
        self._ranks = sorted(ranks) if ranks else list(range(size))
        self._id = self._node.next_group
        self._node.next_group += 1
        self._node.call({"op": "group", "id": self._id, "ranks": rank_runs(self._ranks)})

    def getBackendName(self):
        return BACKEND

    @property
    def supports_splitting(self):
        # `init_process_group(device_id=...)` and device meshes ask; podsim's groups are made
        # whole by `new_group` (each one declared to the chip), never split from a parent.
        return False

    def _get_backend(self, device):
        # This group is its own backend for every device (`batch_isend_irecv` asks for it).
        return self

    def getGroupName(self):
        return self._name

    def setGroupName(self, name):
        self._name = name

    def getGroupDesc(self):
        return self._desc

    def setGroupDesc(self, desc):
        self._desc = desc

    # -- the chip's collectives on one flat float32 buffer --

    def _chip(self, op, values, **fields):
        fields["work"] = work = self._node.next_work
        self._node.next_work += 1
        self._call_works.append(work)
        try:
            if values.is_meta:
                return self._chip_sizes(op, values.numel(), **fields)
            if self._node.meta:
                return self._as_if_every_rank_had(op, values, fields)
            return self._node.call({"op": op, "group": self._id, **fields}, values)
        finally:
            # In flight from here (a wait for it rides on a later request, never this one).
            _streams.issued(work)

    def _done(self, result=None):
        """The work of the entry point that ran the collectives since the last one."""
        works, self._call_works = tuple(self._call_works), []
        return _Done(result, works)

    def _chip_sizes(self, op, words, **fields):
        """Meta mode: the collective runs on the chip on its size alone (`words` float32 words
        of this rank's input); its result is a meta tensor of the size the data would have, so
        that the data path's reshapes and copies run unchanged, as shape rules."""
        self._node.call({"op": op, "group": self._id, "meta": words, **fields})
        n = self.size()
        out = {"all_gather": words * n, "reduce_scatter": words // n}.get(op, words)
        return torch.empty(out, dtype=torch.float32, device="meta")

    def _as_if_every_rank_had(self, op, values, fields):
        """Meta mode, a real tensor (bookkeeping that keeps its value, such as a token count
        summed over the data-parallel ranks): the collective runs on the chip by size, and
        its result is what it would be if every rank of the group held this rank's values,
        the assumption under which one process stands for its ranks. Counted as a stand-in."""
        from . import _meta

        self._chip_sizes(op, values.numel(), **fields)
        _meta.stand_ins[(f"{op} of a real tensor", _call_site() or "an unknown line")] += 1
        n = self.size()
        if op == "all_gather":
            return values.repeat(n)
        if op == "reduce_scatter":
            values = values.view(n, -1)[self.rank()]
        if fields.get("reduce") == "sum":
            return values * n
        return values.clone()  # avg, max, min of n equal values; a broadcast's root's

    def _all_gather_words(self, t):
        words = _as_words(t)
        return self._chip("all_gather", words, dtype="f32").view(self.size(), words.numel())

    def _all_reduce_into(self, t, op):
        op, factor = _premultiplied(op)
        name = _reduce_name(op)
        if t.dtype in _FLOAT_NAMES and name is not None:
            words = _scaled(_as_f32(t), factor)
            out = self._chip("all_reduce", words, reduce=name, dtype=_FLOAT_NAMES[t.dtype])
            t.copy_(out.view(t.shape))
        elif t.is_meta:
            # Sizes only: the reduction of the tensor's bytes, as the TPU runs it (an
            # all-gather of them would charge the group's size times the data).
            self._chip("all_reduce", _as_words(t), reduce="sum", dtype="f32")
        else:
            rows = self._all_gather_words(t)
            stacked = _scaled(torch.stack([_from_words(r, t) for r in rows]), factor)
            t.copy_(_reduce_locally(stacked, op))

    def _reduce_scatter_into(self, out, inp, op):
        n = self.size()
        op, factor = _premultiplied(op)
        name = _reduce_name(op)
        if inp.numel() != n * out.numel():
            raise PodsimError(
                f"podsim: reduce_scatter of {inp.numel()} elements into {out.numel()} per rank "
                f"does not fit a group of {n}"
            )
        if inp.dtype in _FLOAT_NAMES and name is not None:
            words = _scaled(_as_f32(inp), factor)
            got = self._chip("reduce_scatter", words, reduce=name, dtype=_FLOAT_NAMES[inp.dtype])
            out.copy_(got.view(out.shape))
        elif inp.is_meta:
            # Sizes only: the reduce-scatter of the input's bytes, as the TPU runs it.
            self._chip("reduce_scatter", _as_words(inp), reduce="sum", dtype="f32")
        else:
            rows = self._all_gather_words(inp)
            stacked = _scaled(torch.stack([_from_words(r, inp).reshape(-1) for r in rows]), factor)
            mine = _reduce_locally(stacked, op).view(n, -1)[self.rank()]
            out.copy_(mine.view(out.shape))

    def _broadcast_into(self, t, root):
        if t.dtype == torch.float32:
            got = self._chip("broadcast", _as_f32(t), root=root, dtype="f32")
            t.copy_(got.view(t.shape))
        else:
            # Its raw bytes, moved as words and never added: exact for every dtype, and priced
            # as the broadcast it is (an all-gather of them had charged the group's size
            # times the data: 4.5 s for a 0.5 GiB bf16 model's broadcast at 4,096 chips).
            got = self._chip("broadcast", _as_words(t), root=root, dtype="f32")
            t.copy_(_from_words(got, t))

    # -- torch.distributed's entry points (names as the C++ trampoline calls them) --

    def allreduce(self, tensors, opts):
        for t in tensors:
            self._all_reduce_into(t, opts.reduceOp)
        if self._node.meta:
            _meta_counts.carry_collective(tensors, tensors, _alike_ranks_factor(opts.reduceOp, self.size()))
        return self._done(tensors)

    def allreduce_coalesced(self, tensors, opts):
        return self.allreduce(tensors, opts)

    def allgather(self, output_tensors, input_tensors, opts):
        for outs, inp in zip(output_tensors, input_tensors):
            rows = self._all_gather_words(inp)
            if inp.is_meta:
                _meta_counts.carry_collective(outs, [inp])
                continue
            for o, r in zip(outs, rows):
                o.copy_(_from_words(r, inp).view(o.shape))
        return self._done(output_tensors)

    def all_gather_single(self, output, input, opts):
        rows = self._all_gather_words(input)
        if input.is_meta:
            _meta_counts.carry_collective([output], [input])
            return self._done([output])
        parts = [_from_words(r, input).reshape(-1) for r in rows]
        output.copy_(torch.cat(parts).view(output.shape))
        return self._done([output])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self.all_gather_single(o, i, opts)
        return self._done(outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        for out, ins in zip(output_tensors, input_tensors):
            flat = torch.cat([x.reshape(-1) for x in ins])
            self._reduce_scatter_into(out, flat, opts.reduceOp)
        return self._done(output_tensors)

    def reduce_scatter_single(self, output, input, opts):
        self._reduce_scatter_into(output, input.reshape(-1), opts.reduceOp)
        return self._done([output])

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        for o, i in zip(outputs, inputs):
            self._reduce_scatter_into(o, i.reshape(-1), opts.reduceOp)
        return self._done(outputs)

    def broadcast(self, tensors, opts):
        for t in tensors:
            self._broadcast_into(t, opts.rootRank)
        return self._done(tensors)

    def reduce(self, tensors, opts):
        # Every rank gets the result; torch leaves non-roots' buffers unspecified.
        for t in tensors:
            self._all_reduce_into(t, opts.reduceOp)
        return self._done(tensors)

    def gather(self, output_tensors, input_tensors, opts):
        rows = self._all_gather_words(input_tensors[0])
        if self.rank() == opts.rootRank and not rows.is_meta:
            for o, r in zip(output_tensors[0], rows):
                o.copy_(_from_words(r, input_tensors[0]).view(o.shape))
        return self._done(output_tensors)

    def scatter(self, output_tensors, input_tensors, opts):
        out = output_tensors[0]
        root = opts.rootRank
        if self.rank() == root:
            whole = torch.cat([x.reshape(-1) for x in input_tensors[0]])
        else:
            whole = out.new_empty(self.size() * out.numel())
        self._broadcast_into(whole, root)
        out.copy_(whole.view(self.size(), -1)[self.rank()].view(out.shape))
        return self._done(output_tensors)

    def barrier(self, opts):
        self._node.call({"op": "barrier", "group": self._id})
        return self._done()

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):
        n = self.size()
        if not input_split_sizes and not output_split_sizes:
            blocks_in = list(input.reshape(n, -1)) if input.numel() else [input] * n
            blocks_out = list(output.view(n, -1)) if output.numel() else [output] * n
        else:
            ins = list(input_split_sizes) or [input.shape[0] // n] * n
            outs = list(output_split_sizes) or [output.shape[0] // n] * n
            blocks_in = list(torch.split(input.reshape(input.shape[0], -1), ins))
            blocks_out = list(torch.split(output.reshape(output.shape[0], -1), outs))
        equal = not input_split_sizes and not output_split_sizes
        self._all_to_all_blocks(blocks_out, blocks_in, equal)
        if self._node.meta:
            _meta_counts.carry_collective([output], [input])
        return self._done([output])

    def alltoall(self, output_tensors, input_tensors, opts):
        self._all_to_all_blocks(output_tensors, input_tensors)
        if self._node.meta:
            _meta_counts.carry_collective(output_tensors, input_tensors)
        return self._done(output_tensors)

    def _all_to_all_blocks(self, outs, ins, equal=False):
        """Block j of `ins` to rank j; block i of `outs` from rank i. Blocks of unequal size
        are padded to the largest any rank sends (agreed with one small all-reduce)."""
        words = [_as_words(b) for b in ins]
        longest = max((w.numel() for w in words), default=0)
        if not equal and not self._node.meta:  # meta mode: every rank's own sizes
            agreed = torch.tensor([float(longest)])
            longest = int(self._chip("all_reduce", agreed, reduce="max", dtype="f32").item())
        padded = torch.zeros(self.size() * longest, dtype=torch.float32, device=words[0].device if words else "cpu")
        for j, w in enumerate(words):
            padded[j * longest : j * longest + w.numel()] = w
        got = self._chip("all_to_all", padded, dtype="f32").view(self.size(), longest)
        for i, o in enumerate(outs):
            nbytes = o.numel() * o.element_size()
            o.copy_(_from_words(got[i], o, nbytes).view(o.shape))

    # -- point to point: any rank to any rank, along the pod's path between their chips --

    def send(self, tensors, dst, tag):
        # Sends never wait for their receiver (the chip's message is on its way when the
        # call returns), so a send's work is done at once.
        peer = self._ranks[dst]
        for t in tensors:
            words = _as_words(t)
            if words.is_meta:
                self._node.call({"op": "send", "peer": peer, "tag": tag, "meta": words.numel()})
            else:
                self._node.call({"op": "send", "peer": peer, "tag": tag}, words)
        return _Done(tensors)

    def recv(self, tensors, src, tag):
        return _Recv(self._node, tensors, self._ranks[src], tag)

    def recvAnysource(self, tensors, tag):
        raise PodsimError(
            "podsim: recv from any source (src=None) is not supported: name the sending rank"
        )

    def start_coalescing(self, device):
        return None

    def end_coalescing(self, device):
        return _Done()


def _uncounted(method):
    """`method` with the rank's compute counting paused: moving a collective's values in and
    out of the chip's buffers is podsim's work, not the program's (on a TPU the collective
    writes its output in place)."""

    def entry(self, *args, **kwargs):
        compute = self._node.compute
        was, compute.paused = compute.paused, True
        # podsim's own work runs without the function mode: its calls are neither the
        # program's (the replay's observer leaves them out) nor on an accelerator, and the
        # mode costs each a trip through Python.
        steps = self._node.steps
        aside = steps.mode_aside() if steps is not None else None
        try:
            return method(self, *args, **kwargs)
        finally:
            compute.paused = was
            if aside is not None:
                aside.__enter__()

    entry.__name__ = method.__name__
    entry.__doc__ = method.__doc__
    return entry


# The entry points torch.distributed calls (named as the C++ trampoline calls them).
for _name in (
    "allreduce", "allreduce_coalesced", "allgather", "all_gather_single",
    "allgather_into_tensor_coalesced", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced", "broadcast", "reduce", "gather", "scatter", "barrier",
    "alltoall_base", "alltoall", "send", "recv",
):
    setattr(ProcessGroupPodsim, _name, _uncounted(getattr(ProcessGroupPodsim, _name)))


def _create(opts, backend_options):
    ranks = list(opts.global_ranks_in_group or [])
    return ProcessGroupPodsim(opts.group_rank, opts.group_size, ranks, opts.group_id)


# The CPU in data mode, the meta device in meta mode (`podsim._meta`).
dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "meta"])
