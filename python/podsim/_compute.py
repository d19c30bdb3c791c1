"""Counts the compute a rank runs between collectives, at torch's dispatcher, for the chip's
virtual clock: matrix products by shape (the kernel model pads them to the MXU), everything
else as bytes through HBM and a number of kernels.

Views and other ops that move no data cost nothing. Tensor subclasses (DTensor, FSDP2's
parameters) are left to their own dispatch, so their local ops are counted once, on the local
shapes that really run on this chip.
"""

import math
import sys
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from . import _rebind
from ._fusion import Fusion, tensors_of

aten = torch.ops.aten



def _is_dtensor_type(t) -> bool:
    """Whether `t` is DTensor or a subclass of it. A DTensor exists only once its module is
    loaded, so it is looked up there, not imported: importing it (and sympy with it) cost
    every rank 0.85 s of CPU at start, for programs that never use it."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and issubclass(t, dtensor)


# Ops that create no kernel on an accelerator (metadata, aliasing).
_FREE = {
    aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand,
    aten.as_strided, aten.detach, aten.alias, aten.unsqueeze, aten.squeeze, aten.reshape,
    aten.slice, aten.select, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind,
    aten.lift_fresh, aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
    aten.new_empty_strided,
    aten.is_same_size, aten.sym_size, aten.sym_stride, aten.sym_numel,
    # The host reading a value (`.item()`): a copy of a few bytes and a wait, no pass over HBM.
    aten._local_scalar_dense,
}


def _matmul_shapes(packet, args):
    """`(m, k, n, batch)` of a matrix product, or None."""
    if packet is _GROUPED_MM:
        return _grouped_shapes(args[0], args[1], args[2] if len(args) > 2 else None)
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


# A matrix product per group (a mixture of experts' experts), groups cut by offsets.
_GROUPED_MM = getattr(aten, "_grouped_mm", None)


def _grouped_shapes(a, b, offs):
    """`(m, k, n, groups)` of `torch._grouped_mm(a, b, offs)`, the groups taken as equal:
    the offsets are data (a router's choice, unknown in meta mode), and the sum over the
    groups is the same work whatever they are.

    - 2-D `a` `(M, K)` by 3-D `b` `(G, K, N)`: `a`'s rows cut into G groups;
    - 3-D `a` `(G, M, K)` by 2-D `b` `(K, N)`: `b`'s columns cut into G groups;
    - 2-D by 2-D: the contraction `K` cut into G groups (a weight's gradient), out `(G, M, N)`;
    - 3-D by 3-D: a batched product.
    """
    if a.dim() == 3 and b.dim() == 3:
        return a.shape[1], a.shape[2], b.shape[2], a.shape[0]
    groups = offs.shape[0] if offs is not None else (b.shape[0] if b.dim() == 3 else a.shape[0])
    groups = max(int(groups), 1)
    if a.dim() == 2 and b.dim() == 3:
        if a.shape[0] < groups:  # fewer rows than groups: as many products of one row
            return 1, a.shape[1], b.shape[2], a.shape[0]
        return a.shape[0] / groups, a.shape[1], b.shape[2], groups
    if a.dim() == 3:
        return a.shape[1], a.shape[2], b.shape[1] / groups, groups
    return a.shape[0], a.shape[1] / groups, b.shape[1], groups


def _tensor_bytes(x):
    if isinstance(x, torch.Tensor):
        return x.nbytes
    if isinstance(x, (list, tuple)):
        return sum(y.nbytes for y in x if isinstance(y, torch.Tensor))
    return 0


# What each op is, decided once per op overload: 0 costs nothing, 1 is a matrix product,
# 2 a pass over its tensors.
_FREE_KIND, _MATMUL_KIND, _PASS_KIND = 0, 1, 2
_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm} | ({_GROUPED_MM} - {None})


# Namespaces of ops that are no kernels: collectives (and their waits), the chip's
# communication timed on the fabric, and the profiler's markers (`record_function`, which
# FSDP2 wraps around its work: in data mode each was counted as a kernel).
_NOT_KERNELS = {"_c10d_functional", "_c10d_functional_autograd", "c10d", "profiler"}


def _kind_of(func):
    packet = func.overloadpacket
    if packet in _FREE or getattr(func, "is_view", False) or func.namespace in _NOT_KERNELS:
        return _FREE_KIND
    return _MATMUL_KIND if packet in _MATMULS else _PASS_KIND


class Compute(TorchDispatchMode):
    """A dispatch mode accumulating the compute of every op since the last `take()`."""

    @classmethod
    def _should_skip_dynamo(cls):
        # Otherwise torch wraps `__torch_dispatch__` in `torch._dynamo.disable`, whose first
        # call imports dynamo: about 2 s of CPU per rank, for a guard against tracing that
        # only a torch.compile'd program (which imports dynamo itself) could need.
        return False

    def __init__(self, eager: str = "fused") -> None:
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
        # Whether the mode is on the dispatch stack (`counting`).
        self.on_stack = False
        # Set while `torch.utils.checkpoint` recomputes a forward inside backward: its matmuls
        # and attention are also counted apart (`_recomputed`), so that MFU leaves them out.
        self.recomputing = False
        self._recomputed_matmuls = {}
        self._recomputed_attention = {}
        # The rank's HBM, when counted (`Memory`).
        self.memory = None
        # `fused` eager mode: element-wise ops fused into kernels (`Fusion`); None in
        # `strict` and `debug`, where every op is its own kernel.
        self.fusion = Fusion() if eager == "fused" else None
        # Meta mode: ops on real (CPU) tensors are the host's bookkeeping (an optimizer's step
        # count), not the chip's kernels; in data mode every op runs for the chip.
        self.host_ops_free = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in types:
            if t is not torch.Tensor and t is not torch.nn.Parameter:
                if _is_dtensor_type(t):
                    # DTensor's dispatch runs the local ops, which come back here and are
                    # counted on the shapes that really run on this chip.
                    return NotImplemented
                # Other subclasses (fake tensors of sharding propagation, functional
                # wrappers) run nothing on the chip: not counted.
                return func(*args, **(kwargs or {}))
        if not types and self.memory is not None and not self.paused:
            # A factory asking for more than the chip has left fails before it allocates: past
            # the host's memory too, it failed as the host's error, not the chip's.
            self.memory.check_factory(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        if not types and _made_by_a_mode_below(out):
            # A factory (no tensor arguments) answered by a mode under this one: DTensor's
            # sharding propagation makes its global-shape fake arguments this way, under a
            # FakeTensorMode. Shapes for torch's own bookkeeping, nothing on the chip.
            return out
        if self.paused or (self.host_ops_free and not _on_meta(args, out)):
            return out
        kind = self._kinds.get(func)
        if kind is None:
            kind = self._kinds[func] = _kind_of(func)
        if self.memory is not None and (kind != _PASS_KIND or self.fusion is None):
            # A fused kernel's results are in HBM only if it writes them (`Fusion`).
            self.memory.allocated(out, func)
        if kind == _FREE_KIND:
            return out
        try:
            if kind == _MATMUL_KIND:
                self.reads(args)
                m, k, n, batch = _matmul_shapes(func.overloadpacket, args)
                # `args[1]`: the second factor (`addmm`'s and `baddbmm`'s first is the bias).
                key = (round(m), round(k), round(n), args[1].element_size())
                self._matmuls[key] = self._matmuls.get(key, 0) + int(batch)
                if self.recomputing:
                    done = self._recomputed_matmuls
                    done[key] = done.get(key, 0) + int(batch)
            elif self.fusion is not None:
                self.fusion.add(self, args, out, func)
            else:
                self._pass_bytes += _tensor_bytes(out)
                for a in args:
                    self._pass_bytes += _tensor_bytes(a)
                self._kernels += 1
        except torch.OutOfMemoryError:
            raise
        except Exception:  # counting must never break the user's program
            pass
        return out

    def __enter__(self):
        self.on_stack = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.on_stack = False
        return super().__exit__(*exc)

    def counting(self) -> bool:
        """Whether the rank's ops are being counted now: the mode is on the stack (a replayed
        step takes it off, `podsim._replay`) and podsim is not moving tensors itself."""
        return self.on_stack and not self.paused

    def take(self) -> dict:
        """The compute since the previous call, as the chip reads it (and reset)."""
        if self.fusion is not None:
            self.fusion.price_open(self)
        c = {
            "matmuls": [[m, k, n, calls, eb] for (m, k, n, eb), calls in self._matmuls.items()],
            "pass_bytes": self._pass_bytes,
            "kernels": self._kernels,
            "attention": [[*key, calls] for key, calls in self._attention.items()],
        }
        if self._recomputed_matmuls or self._recomputed_attention:
            c["recomputed_matmuls"] = [[m, k, n, calls, eb] for (m, k, n, eb), calls
                                       in self._recomputed_matmuls.items()]
            c["recomputed_attention"] = [[*key, calls] for key, calls
                                         in self._recomputed_attention.items()]
            self._recomputed_matmuls, self._recomputed_attention = {}, {}
        self._attention = {}
        self._matmuls = {}
        self._pass_bytes = 0
        self._kernels = 0
        return c

    def unpriced(self, fn, *args, **kwargs):
        """`fn(...)`'s ops uncounted (their kernel was priced whole), its results still held
        in HBM (what a flash kernel writes; not its intermediates)."""
        was, self.paused = self.paused, True
        try:
            out = fn(*args, **kwargs)
        finally:
            self.paused = was
        if self.memory is not None and not was:
            self.memory.allocated(out, "scaled_dot_product_attention")
        return out

    def end_kernels(self):
        """The step ends: every open fused kernel closes (priced by the next `take`)."""
        if self.fusion is not None:
            self.fusion.close_all(self)

    def reads(self, tensors):
        """A kernel other than a pass reads `tensors`: fused kernels producing them close
        first, and values they left unwritten are recomputed (a pass over their sources)."""
        if self.fusion is not None:
            self._pass_bytes += self.fusion.reads(self, [t for a in tensors for t in tensors_of(a)])

    def add_attention(self, q, k, v, causal, backward):
        """One attention kernel on `q` `(batch, heads, seq, head_dim)` against `k` and `v`,
        priced as flash attention (the chip's kernel), not as the decomposition torch runs
        here."""
        if self.paused:
            return
        self.reads((q, k, v))
        *lead, heads, seq, head_dim = q.shape
        batch = 1
        for d in lead:
            batch *= int(d)
        key = (batch, int(max(seq, k.shape[-2])), int(heads), int(head_dim), int(bool(causal)),
               int(bool(backward)), q.element_size())
        self._attention[key] = self._attention.get(key, 0) + 1
        if self.recomputing:
            done = self._recomputed_attention
            done[key] = done.get(key, 0) + 1


def _made_by_a_mode_below(out) -> bool:
    """Whether a factory's result is a tensor subclass (a fake tensor), not a plain tensor
    the program gets."""
    t = out[0] if isinstance(out, (list, tuple)) and out else out
    return isinstance(t, torch.Tensor) and type(t) is not torch.Tensor


def _on_meta(args, out):
    """Whether an op touched a meta tensor (the chip's, in meta mode)."""
    return any(t.is_meta for a in (*args, out) for t in tensors_of(a))


def recomputation_apart(compute: "Compute") -> None:
    """Work `torch.utils.checkpoint` recomputes inside backward is counted apart as well
    (`Compute.recomputing`): the checkpointed function, called again while autograd runs a
    backward, is the recomputation, whichever checkpoint implementation calls it."""
    import torch.utils.checkpoint as cp

    original = cp.checkpoint

    def checkpoint(function, *args, **kwargs):
        def run(*a, **k):
            if torch._C._current_graph_task_id() == -1:  # the forward itself
                return function(*a, **k)
            was, compute.recomputing = compute.recomputing, True
            try:
                return function(*a, **k)
            finally:
                compute.recomputing = was

        return original(run, *args, **kwargs)

    # Programs import it by name (`from torch.utils.checkpoint import checkpoint`), as does
    # torch's own checkpoint wrapper, before the rank connects and this runs.
    _rebind.everywhere(original, checkpoint, ("checkpoint", "torch_utils_checkpoint"))


def _flash_attention(compute: "Compute"):
    """`attend(q, k, v)` run as one flash-attention kernel forward and one backward on the
    chip's clock, whatever torch decomposes it into on this host (the CPU's kernel, or on the
    meta device the math path with its full score matrix, which no TPU materialises). The
    backward recomputes the forward, as flash attention does, so nothing is kept but q, k, v.
    `attend` returns the output, or the output and values no gradient flows through (a
    log-sum-exp)."""

    class FlashAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, attend, causal, q, k, v):
            compute.add_attention(q, k, v, causal, backward=False)
            ctx.attend, ctx.causal = attend, causal
            ctx.save_for_backward(q, k, v)
            out = compute.unpriced(attend, q.detach(), k.detach(), v.detach())
            if isinstance(out, tuple):
                ctx.mark_non_differentiable(*out[1:])
            return out

        @staticmethod
        def backward(ctx, grad, *_):
            q, k, v = ctx.saved_tensors
            compute.add_attention(q, k, v, ctx.causal, backward=True)

            def grads():
                with torch.enable_grad():
                    inputs = [x.detach().requires_grad_(True) for x in (q, k, v)]
                    out = ctx.attend(*inputs)
                    out = out[0] if isinstance(out, tuple) else out
                    if out.grad_fn is None:  # shaped, not computed: gradients are shapes too
                        return tuple(torch.empty_like(x) for x in inputs)
                    return torch.autograd.grad(out, inputs, grad)

            return (None, None, *compute.unpriced(grads))

    def attention(attend, q, k, v, causal):
        if not torch.is_grad_enabled() or not any(x.requires_grad for x in (q, k, v)):
            compute.add_attention(q, k, v, causal, backward=False)
            return compute.unpriced(attend, q, k, v)
        return FlashAttention.apply(attend, causal, q, k, v)

    return attention


def price_attention_as_flash(compute: "Compute") -> None:
    """`F.scaled_dot_product_attention` and `flex_attention` counted as flash attention
    (`_flash_attention`). With dropout SDPA's values would differ on recomputation, so such
    calls are counted as they run."""
    F = torch.nn.functional
    sdpa = F.scaled_dot_product_attention
    flash = _flash_attention(compute)
    price_flex_attention_as_flash(flash)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                     is_causal=False, scale=None, enable_gqa=False):
        kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal,
                  "scale": scale, "enable_gqa": enable_gqa}
        plain = all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in (query, key, value))
        local = None if plain or attn_mask is not None else _head_parallel(query, key, value)
        if local is not None:
            return local(lambda q, k, v: scaled_dot_product_attention(q, k, v, **kwargs))
        if dropout_p or not plain or attn_mask is not None and attn_mask.requires_grad:
            return sdpa(query, key, value, **kwargs)
        return flash(lambda q, k, v: sdpa(q, k, v, **kwargs), query, key, value, is_causal)

    F.scaled_dot_product_attention = scaled_dot_product_attention


def price_flex_attention_as_flash(flash) -> None:
    """`flex_attention` counted as flash attention by `flash` (`_flash_attention`). A block
    mask is priced as causal attention: its sparsity is not known on the meta device, and
    the masks language models use (causal, causal within documents, a sliding window) keep
    at most that much. On real tensors the values are torch's own; on meta tensors torch
    refuses the device, and the output (and log-sum-exp) are shaped here."""
    try:
        import torch.nn.attention.flex_attention as fa
    except ImportError:  # a torch without flex attention
        return
    original = fa.flex_attention

    def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                       enable_gqa=False, return_lse=False, kernel_options=None, *,
                       return_aux=None):
        plain = all(type(x) in (torch.Tensor, torch.nn.Parameter) for x in (query, key, value))
        if not plain or query.dim() != 4:
            return original(query, key, value, score_mod, block_mask, scale, enable_gqa,
                            return_lse, kernel_options, return_aux=return_aux)
        lse_asked = return_lse or return_aux is not None and getattr(return_aux, "lse", False)

        def attend(q, k, v):
            if q.is_meta:
                out = q.new_empty((*q.shape[:-1], v.shape[-1]))
                return out, q.new_empty(q.shape[:-1], dtype=torch.float32)
            # torch's flex attention is a higher-order op, which no dispatch mode of
            # podsim's may see; its kernel is priced whole anyway.
            with _disable_current_modes():
                out, aux = original(q, k, v, score_mod, block_mask, scale, enable_gqa,
                                    kernel_options=kernel_options,
                                    return_aux=fa.AuxRequest(lse=True))
            return out, aux.lse

        out, lse = flash(attend, query, key, value, block_mask is not None)
        if return_aux is not None:
            return out, fa.AuxOutput(lse=lse if lse_asked else None)
        return (out, lse) if return_lse else out

    fa.flex_attention = flex_attention
    _rebind.everywhere(original, flex_attention, ("flex_attention",))


def _head_parallel(query, key, value):
    """Attention of DTensors laid out alike and split only over batch or heads (tensor
    parallelism's layout) is each rank's attention of its local blocks, as DTensor's own
    flash-attention rule runs it on an accelerator: a function running `attend` on the local
    tensors and giving the result as a DTensor of that layout (`None` for other layouts,
    which torch's own decomposition handles)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:
        return None
    if not all(isinstance(x, DTensor) for x in (query, key, value)):
        return None
    placements = query.placements
    alike = all(x.placements == placements and x.device_mesh == query.device_mesh
                for x in (key, value))
    ndim = query.dim()
    local_dims = all(p.is_replicate() or isinstance(p, Shard) and p.dim % ndim < ndim - 2
                     for p in placements)
    if not alike or not local_dims:
        return None

    def local(attend):
        out = attend(query.to_local(), key.to_local(), value.to_local())
        return DTensor.from_local(out, query.device_mesh, placements, run_check=False)

    return local


# What a rank's device holds, by kind (the report's names).
KINDS = ("parameters", "gradients", "optimizer state", "saved activations", "transients")
_SAVED, _TRANSIENT = KINDS[3], KINDS[4]


class Memory:
    """The rank's live device bytes, counted at the dispatcher as the chip's HBM: every
    storage an op allocates on the rank's device (the CPU in data mode, the meta device in
    meta mode) is live until torch frees it (a finalizer on the storage; views share it).
    Storages start as transients and are moved to their kind when the program shows what
    they are: saved activations when autograd saves them for backward (`podsim._saved`), a
    module's parameters when it runs, an optimizer's gradients when it steps, its state
    after. Past the modelled chip's capacity the op
    raises `torch.OutOfMemoryError`, as a real chip's allocator does."""

    def __init__(self, device_type: str, capacity: int, hardware: str) -> None:
        self.device_type = device_type
        self.capacity = capacity
        self.hardware = hardware
        self.live = {}  # storage id -> [bytes, kind]
        self.by_kind = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.peak = 0
        self.peak_by_kind = dict(self.by_kind)
        # The peak `torch.cuda.max_memory_allocated` reports: since the program last reset it.
        self.program_peak = 0
        # Set while the program makes tensors it asked to have on the meta device itself
        # (`with torch.device("meta")`): no memory on any device, in meta mode as in a real run.
        self.untracked = 0
        self.ignored = set()
        # Storages of results a fused kernel did not write (`Fusion`): no HBM, views included.
        self.unwritten = set()
        # Storages autograd saved before they were counted (a fused kernel's result, counted
        # when the kernel closes): saved activations once they are.
        self.saved_early = set()

    def allocated(self, out, func):
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                if self.untracked:
                    self._ignore(t)
                else:
                    self.track(t.untyped_storage(), func)

    def _ignore(self, t):
        """`t`'s storage is the program's own meta tensor: never counted, even when an op
        writes it in place later (a module's `reset_parameters`)."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.ignored and key not in self.live:
            self.ignored.add(key)
            weakref.finalize(storage, self.ignored.discard, key)

    def track(self, storage, func):
        """`storage` is in HBM from now until torch frees it."""
        key = storage._cdata
        if key in self.live or key in self.ignored or key in self.unwritten:
            return
        n = storage.nbytes()
        kind = _SAVED if key in self.saved_early else _TRANSIENT
        self.live[key] = [n, kind]
        self.by_kind[kind] += n
        self.total += n
        weakref.finalize(storage, self._freed, key)
        self._raise_peaks()
        if self.capacity and self.total > self.capacity:
            self._out_of_memory(func)

    def _raise_peaks(self):
        if self.total > self.peak:
            self.peak = self.total
            self.peak_by_kind = dict(self.by_kind)
        self.program_peak = max(self.program_peak, self.total)

    def replayed(self, step_peak):
        """A replayed step peaked at `step_peak` bytes, which the dispatcher did not see."""
        self.program_peak = max(self.program_peak, step_peak)

    def reset_program_peak(self):
        self.program_peak = self.total

    def _freed(self, key):
        entry = self.live.pop(key, None)
        if entry is not None:
            self.by_kind[entry[1]] -= entry[0]
            self.total -= entry[0]

    def resized(self, storage):
        """`storage` changed size in place (FSDP2 frees and refills its unsharded parameters
        with `untyped_storage().resize_`, keeping the storage)."""
        entry = self.live.get(storage._cdata)
        if entry is None:
            return
        n = storage.nbytes()
        self.by_kind[entry[1]] += n - entry[0]
        self.total += n - entry[0]
        entry[0] = n
        self._raise_peaks()
        if self.capacity and self.total > self.capacity:
            self._out_of_memory("UntypedStorage.resize_")

    def classify(self, tensor, kind):
        """`tensor`'s storage is of `kind` (a DTensor's local shard is what the chip holds)."""
        tensor = getattr(tensor, "_local_tensor", tensor)
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
            return
        entry = self.live.get(tensor.untyped_storage()._cdata)
        if entry is not None and entry[1] != kind:
            self.by_kind[entry[1]] -= entry[0]
            self.by_kind[kind] += entry[0]
            entry[1] = kind

    def saved(self, tensor):
        """Autograd saved `tensor` for backward: a transient storage is a saved activation
        (a parameter or gradient saved by its op keeps its kind)."""
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self.live.get(key)
        if entry is None and key not in self.ignored and key not in self.saved_early:
            self.saved_early.add(key)
            weakref.finalize(storage, self.saved_early.discard, key)
        elif entry is not None and entry[1] == _TRANSIENT:
            self.by_kind[_TRANSIENT] -= entry[0]
            self.by_kind[_SAVED] += entry[0]
            entry[1] = _SAVED

    def take_step(self):
        """The peak since the previous step and its split by kind (then the next step's peak
        starts from what is live now)."""
        step = {"peak_bytes": self.peak, "by_kind": [[k, v] for k, v in self.peak_by_kind.items()]}
        self.peak = self.total
        self.peak_by_kind = dict(self.by_kind)
        return step

    def check_factory(self, func, args, kwargs):
        """Data mode: a factory (`torch.empty(size)`, `zeros`, `full`...) on the rank's device
        that would take the live bytes past the chip's capacity raises now, before it
        allocates. (Meta mode allocates nothing on the host; and a factory asked for the meta
        device by name is the program's own meta tensor there, never counted.)"""
        if self.device_type == "meta" or not self.capacity:
            return
        if not args or not isinstance(args[0], (list, tuple, torch.Size)):
            return
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != self.device_type:
            return
        try:
            elements = math.prod(int(d) for d in args[0])
        except (TypeError, ValueError):
            return  # symbolic sizes: counted when made
        asked = elements * (kwargs.get("dtype") or torch.get_default_dtype()).itemsize
        if self.total + asked > self.capacity:
            self._out_of_memory(func, asked)

    def _out_of_memory(self, func, asked=0):
        from .torch import _call_site

        capacity, self.capacity = self.capacity, 0  # raised once; what follows is the program's
        gib = 1 << 30
        kinds = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in self.by_kind.items())
        asking = f" and {asked / gib:.2f} GiB asked for" if asked else ""
        raise torch.OutOfMemoryError(
            f"podsim: out of HBM: {self.total / gib:.2f} GiB live{asking} on a {self.hardware} "
            f"chip of {capacity / gib:.2f} GiB, at {func} ({_call_site() or 'an unknown line'}); "
            f"{kinds}"
        )
