"""DDP in meta mode: torch's `DistributedDataParallel` as is, its C++ reducer stood in for.

DDP's Python side (arguments, device meshes, `no_sync`, buffer broadcasts, comm hooks) runs
unchanged; what it hands to C++ cannot run on meta tensors: the check of parameter shapes
reads their data, the broadcast of rank 0's parameters flattens them, and the reducer copies
every gradient into its buckets. Those three are replaced here, in meta mode only, by Python
that issues the collectives they issue, of the sizes and in the order they issue them:

- the shape check: an all-gather of the parameter count, a broadcast of every parameter's
  sizes and strides (int64);
- `_broadcast_coalesced` (the parameters at construction, the buffers before each forward):
  the tensors grouped by dtype into buckets of at most the given bytes, one broadcast each;
- the reducer: gradients land in buckets as they become ready (divided by the group size);
  a bucket is all-reduced, `async_op` on the chip's communication stream, once it and every
  bucket before it are complete; the backward ends by waiting for them all and copying the
  results back. The first iteration's buckets are the ones DDP gives (one per dtype unless
  `find_unused_parameters`); before the second forward they are rebuilt in the order the
  gradients became ready, the first of 1 MiB then `bucket_cap_mb` each, as the C++ reducer
  rebuilds them (rank 0's buckets broadcast to every rank). With `find_unused_parameters`,
  parameters the forward did not reach are ready at once and the used-parameter map is
  all-reduced too; with `static_graph`, the first backward reduces everything at its end.
- comm hooks (`register_comm_hook`, torch's built-in ones) get a bucket with the same methods
  as torch's `GradBucket`; what they issue is the bucket's communication.

So a DDP program in meta mode shows on the virtual clock what it does on the hardware: the
buckets' all-reduces overlap the rest of the backward, and only the tail is exposed.
"""

import torch
import torch.distributed as dist

from . import _streams

_MIB = 1024 * 1024


def install():
    import torch.nn.parallel.distributed as ddp_module

    ddp_module._verify_param_shape_across_processes = verify_param_shapes
    dist._broadcast_coalesced = broadcast_coalesced
    dist.Reducer = Reducer
    dist.Logger = QuietLogger
    dist._register_comm_hook = _register_comm_hook
    dist._register_builtin_comm_hook = _register_builtin_comm_hook


def verify_param_shapes(process_group, tensors, logger=None):
    """`_verify_params_across_processes`: the parameter count gathered from every rank, then
    rank 0's sizes and strides broadcast. (The values cannot be compared here; ranks whose
    shapes differ broadcast different sizes, which podsim reports as a desync.)"""
    group = process_group or dist.group.WORLD
    count = torch.empty(1, dtype=torch.int64, device="meta")
    counts = torch.empty(group.size(), dtype=torch.int64, device="meta")
    dist.all_gather_into_tensor(counts, count, group=group)
    words = sum(2 * t.dim() for t in tensors)
    metadata = torch.empty(words, dtype=torch.int64, device="meta")
    dist.broadcast(metadata, dist.get_global_rank(group, 0), group=group)


def broadcast_coalesced(process_group, tensors, buffer_size, src=0):
    """Rank `src`'s tensors to every rank, flattened into buckets of at most `buffer_size`
    bytes per dtype (C++ `broadcast_coalesced`), one broadcast per bucket."""
    if not tensors:
        return
    buckets, _ = dist._compute_bucket_assignment_by_size(list(tensors), [buffer_size])
    root = dist.get_global_rank(process_group, src)
    for bucket in buckets:
        parts = [tensors[i] for i in bucket]
        flat = torch.cat([t.detach().reshape(-1) for t in parts])
        dist.broadcast(flat, root, group=process_group)
        offset = 0
        for t in parts:
            t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class QuietLogger:
    """DDP's usage logger (construction data, runtime stats): nothing to log in meta mode."""

    def __init__(self, reducer=None):
        pass

    def _get_ddp_logging_data(self):
        return {}

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None


class GradBucket:
    """What a comm hook is handed: `torch.distributed.GradBucket`'s methods over one bucket."""

    def __init__(self, bucket, index, last):
        self._bucket, self._index, self._last = bucket, index, last

    def index(self):
        return self._index

    def buffer(self):
        return self._bucket.flat

    def set_buffer(self, tensor):
        self._bucket.flat = tensor

    def gradients(self):
        return self._bucket.views()

    def parameters(self):
        return list(self._bucket.params)

    def is_last(self):
        return self._last

    def offsets(self):
        return list(self._bucket.offsets)

    def lengths(self):
        return [p.numel() for p in self._bucket.params]

    def sizes_list(self):
        return [p.shape for p in self._bucket.params]


class _Bucket:
    """A flat buffer of one dtype holding some parameters' gradients, in bucket order."""

    def __init__(self, params, indices):
        self.params, self.indices = params, indices
        self.offsets, total = [], 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        # Made from the parameter, not with `device="meta"`: a factory asked for the meta device
        # by name is taken for the program's own meta tensor and not counted, and the C++
        # reducer's buckets are in HBM (a gradient's size more than the parameters).
        self.flat = params[0].new_empty(total)
        self.pending, self.works, self.future = len(params), [], None

    def view(self, position):
        p, offset = self.params[position], self.offsets[position]
        return self.flat[offset:offset + p.numel()].view_as(p)

    def views(self):
        return [self.view(i) for i in range(len(self.params))]


class Reducer:
    """The C++ reducer's behaviour DDP relies on, over meta tensors (see the module doc).
    Arguments are the C++ constructor's, in its order; those after the first bucket's cap
    (unused-parameter skipping, the Python reducer, lazy allocation) change nothing here but
    the limits for rebuilding, when given."""

    def __init__(self, params, bucket_indices, per_bucket_size_limits, process_group,
                 expect_sparse_gradients=(), bucket_bytes_cap=25 * _MIB,
                 find_unused_parameters=False, gradient_as_bucket_view=False,
                 param_names=None, first_bucket_bytes_cap=_MIB, *rest):
        self.params = list(params)
        self.group = process_group
        self.find_unused = find_unused_parameters
        self.as_bucket_view = gradient_as_bucket_view
        rebuild_limits = rest[2] if len(rest) > 2 else None  # `bucket_size_limits_for_rebuilding`
        self.rebuild_limits = list(rebuild_limits or []) or [first_bucket_bytes_cap,
                                                              bucket_bytes_cap]
        self.static_graph = False
        self.has_rebuilt = False
        self.rebuilt = []  # parameter indices in the order their gradients became ready
        self.backwards = 0
        self.comm_hook = None
        self.expect_hooks = False
        self.require_finalize = False
        self._initialize_buckets(bucket_indices)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i))
                        for i, p in enumerate(self.params) if p.requires_grad]
        self._reset_backward()

    def _initialize_buckets(self, bucket_indices):
        # The old buckets go first, as the C++ reducer clears its own before making new ones:
        # both alive at once would peak a gradient's size above what the chip holds.
        self.buckets = []
        self.buckets = [_Bucket([self.params[i] for i in b], list(b)) for b in bucket_indices]
        self.where = {i: (b, position) for b, bucket in enumerate(self.buckets)
                      for position, i in enumerate(bucket.indices)}

    def _reset_backward(self):
        self.ready = set()
        self.next_bucket = 0
        self.unused = []
        self.marked_unused = False
        self.used_map_work = None
        for bucket in self.buckets:
            bucket.pending, bucket.works, bucket.future = len(bucket.params), [], None

    def _should_rebuild(self):
        return (self.static_graph or not self.find_unused) and not self.has_rebuilt

    def _static_first_backward(self):
        return self.static_graph and self.backwards == 1

    # -- what DDP calls --

    def set_logger(self, logger):
        pass

    def prepare_for_forward(self):
        pass

    def prepare_for_backward(self, outputs):
        if self.require_finalize:
            raise RuntimeError(
                "Expected to have finished reduction in the prior iteration before starting a "
                "new one. This error indicates that your module has parameters that were not "
                "used in producing loss. You can enable unused parameter detection by passing "
                "the keyword argument `find_unused_parameters=True` to "
                "`torch.nn.parallel.DistributedDataParallel` (podsim meta mode: parameter "
                f"indices never ready: {self._never_ready()})")
        self._reset_backward()
        self.backwards += 1
        self.expect_hooks = True
        self.require_finalize = True
        if self.find_unused and not self.static_graph:
            reached = _reached_parameters(outputs)
            self.unused = [i for i, p in enumerate(self.params) if id(p) not in reached]

    def _rebuild_buckets(self):
        """Before the second forward: buckets in the order gradients became ready."""
        if not self._should_rebuild() or len(self.rebuilt) != len(self.params):
            return False
        order = self.rebuilt
        buckets, _ = dist._compute_bucket_assignment_by_size(
            [self.params[i] for i in order], self.rebuild_limits, [], order)
        # Rank 0's buckets for every rank (`sync_bucket_indices`): the indices and the bucket
        # count, then each bucket's length.
        root = dist.get_global_rank(self.group, 0)
        for words in (len(order) + 1, len(buckets)):
            sizes = torch.empty(words, dtype=torch.int32, device=self.params[0].device)
            dist.broadcast(sizes, root, group=self.group)
        self._initialize_buckets(buckets)
        self.has_rebuilt = True
        return True

    def _push_all_rebuilt_params(self):
        if self._should_rebuild() and not self.rebuilt:
            self.rebuilt = list(range(len(self.params)))

    def _set_static_graph(self):
        self.static_graph = True

    def _delay_all_reduce(self):
        """Static graph, first backward: every bucket reduced once the backward is done."""
        for i in range(len(self.params)):
            if i not in self.ready:
                self._mark_ready(i, finalize_when_done=False)
        self._finalize()

    def _set_mixed_precision_param_dtype(self, dtype):
        raise NotImplementedError(
            "DDP's mixed_precision option (a private one) is not supported in podsim's meta "
            "mode; autocast, or parameters in the low precision, are")

    def _set_forward_pass_work_handle(self, work, divide_by_initial_world_size):
        pass

    def _set_ddp_runtime_logging_sample_rate(self, rate):
        pass

    def _check_reducer_finalized(self):
        if self.require_finalize:
            raise RuntimeError("DDP's reducer did not finish the previous backward "
                               f"(parameter indices never ready: {self._never_ready()})")

    def _reset_state(self):
        self.require_finalize = False
        self.expect_hooks = False

    def _remove_autograd_hooks(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _get_local_used_map(self):
        return torch.ones(len(self.params), dtype=torch.int32, device=self.params[0].device)

    # -- the backward --

    def _hook(self, index):
        def on_gradient(param):
            if not self.expect_hooks:
                return
            if self._static_first_backward():
                return  # `_delay_all_reduce` reduces everything at the end of the backward
            if not self.marked_unused:
                self.marked_unused = True
                for i in self.unused:
                    self._mark_ready(i)
            if self._should_rebuild():
                self.rebuilt.append(index)
            self._mark_ready(index)

        return on_gradient

    def _mark_ready(self, index, finalize_when_done=True):
        """The gradient of parameter `index` into its bucket (divided by the group size unless a
        comm hook does it), then every complete bucket whose turn it is all-reduced."""
        if index in self.ready:
            raise RuntimeError(f"DDP: parameter {index} was marked ready twice in one backward")
        self.ready.add(index)
        b, position = self.where[index]
        bucket = self.buckets[b]
        grad, view = self.params[index].grad, bucket.view(position)
        if grad is not None:
            if self.comm_hook is None:
                torch.mul(grad, 1.0 / self.group.size(), out=view)
            else:
                view.copy_(grad)
        bucket.pending -= 1
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].pending == 0:
            self._all_reduce(self.next_bucket)
            self.next_bucket += 1
        if self.next_bucket == len(self.buckets) and finalize_when_done:
            if self.find_unused and not self.static_graph:
                used = torch.empty(len(self.params), dtype=torch.int32, device=view.device)
                self.used_map_work = dist.all_reduce(used, group=self.group, async_op=True)
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)

    def _all_reduce(self, b):
        bucket = self.buckets[b]
        if self.comm_hook is None:
            bucket.works = [dist.all_reduce(bucket.flat, group=self.group, async_op=True)]
            return
        state, hook = self.comm_hook
        with _streams.recording() as works:
            bucket.future = hook(state, GradBucket(bucket, b, b == len(self.buckets) - 1))
        bucket.works = works

    def _finalize(self):
        """The end of the backward: every bucket waited for, its results the gradients."""
        if not self.expect_hooks:
            return
        self.expect_hooks = False
        self.require_finalize = False
        for bucket in self.buckets:
            for work in bucket.works:
                work.wait()
            if bucket.future is not None:
                result = bucket.future.wait()
                result = result[0] if isinstance(result, (list, tuple)) else result
                if result is not bucket.flat:
                    bucket.flat.copy_(result)
            for position, p in enumerate(bucket.params):
                if p.grad is None:
                    continue
                if self.as_bucket_view:
                    p.grad = bucket.view(position)  # the bucket holds the gradient from now on
                else:
                    p.grad.copy_(bucket.view(position))
        if self.used_map_work is not None:
            self.used_map_work.wait()

    def _never_ready(self):
        return sorted(set(range(len(self.params))) - self.ready)[:8]


def _reached_parameters(outputs):
    """The ids of the parameters whose gradient accumulators the outputs' graph reaches."""
    seen, reached = set(), set()
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return reached


def _register_comm_hook(reducer, state, hook):
    reducer.comm_hook = (state, hook)


def _register_builtin_comm_hook(reducer, comm_hook_type):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooks = {
        dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
        dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
    }
    reducer.comm_hook = (reducer.group, hooks[comm_hook_type])

