"""Runs a PyTorch program on podsim unedited: loaded before the program by the rank's
interpreter (``podsim run`` puts a ``sitecustomize`` on its ``PYTHONPATH``), it

- makes every process group podsim's, whatever backend the program names (``"nccl"``,
  ``"gloo"``, none, ``"cpu:gloo,cuda:nccl"``), so that no collective goes around the pod;
- puts what the program asks of a GPU on podsim's device: ``cuda`` devices, ``.cuda()``,
  ``torch.cuda.set_device`` and device meshes of ``"cuda"`` land on the CPU in data mode and on
  the meta device in meta mode, and ``torch.cuda``'s memory API reads the chip's HBM;
- in meta mode (:mod:`podsim._meta`) gives every large tensor shape, dtype and device but no
  storage, and a defined stand-in to whatever needs a value;
- ends a step at every ``optimizer.step()`` unless the program marks its own steps;
- runs what the program ``torch.compile``\ s eagerly, so that every op is priced;
- tells the chip about an exception that ends the program, with its line.

``podsim run --no-intercept`` leaves the program as it is.
"""

import contextlib
import functools
import importlib
import importlib.abc
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from . import _device_memory, _rebind, _streams
from . import torch as backend

_installed = False


def mode():
    """`data` or `meta`: the job's mode, as the worker set it."""
    return os.environ.get("PODSIM_MODE", "data")


def device():
    """Where the program's device tensors live: the CPU, or the meta device in meta mode."""
    return torch.device("meta" if mode() == "meta" else "cpu")


def boot():
    """Installs every interception before a rank's program runs, or ends the process saying
    why (exit 2): a program must never run around the pod. The rank's `sitecustomize.py`
    calls it, and a rank server's forked child (`podsim._prefork`)."""
    try:
        install()
    except Exception:
        import traceback

        traceback.print_exc()
        sys.stderr.write("podsim: cannot set up podsim's torch backend (above)\n")
        sys.stderr.flush()
        os._exit(2)


def install():
    """Installs every interception (once)."""
    global _installed
    if _installed:
        return
    _installed = True
    _every_group_is_podsims()
    _devices_are_podsims()
    _steps_at_optimizer_steps()
    _streams_are_podsims()
    _compile_runs_eagerly()
    _exceptions_reach_the_chip()
    _spawn_runs_this_rank()
    if mode() == "meta":
        from . import _meta

        _meta.install()


# ---- process groups ------------------------------------------------------------------------


def _every_group_is_podsims():
    """Every process group is made by podsim's backend: the one place torch makes a group's
    backend (`_new_process_group_helper`) serves `init_process_group`, `new_group`,
    `new_subgroups`, `split_group` and device meshes alike."""
    make = c10d._new_process_group_helper

    def podsim_group(group_size, group_rank, global_ranks_in_group, backend_name, *args, **kw):
        return make(group_size, group_rank, global_ranks_in_group, backend.BACKEND, *args, **kw)

    c10d._new_process_group_helper = podsim_group

    start = c10d.init_process_group

    def init_process_group(backend_name=None, *args, **kwargs):
        kwargs.pop("backend", None)  # named as a keyword: replaced all the same
        # podsim's ranks meet on their chips, not at a TCP store: a store in each process
        # serves torch's own bookkeeping, and no rank waits at a rendezvous for ranks that a
        # representative stands for (meta mode runs one process for many ranks).
        kwargs.pop("init_method", None)
        if not args and "store" not in kwargs:
            kwargs["store"] = dist.HashStore()
            kwargs.setdefault("rank", int(os.environ["RANK"]))
            kwargs.setdefault("world_size", int(os.environ["WORLD_SIZE"]))
        _check_world(kwargs.get("rank"), kwargs.get("world_size"))
        return start(backend.BACKEND, *args, **kwargs)

    # `DeviceMesh` makes the default group with its own copy of the function.
    _rebind.everywhere(start, init_process_group, ("init_process_group",))



def _check_world(rank, world_size):
    """A rank and world size the program names itself (a spawned program's own count) must be
    the pod's: one rank per chip."""
    pod_rank, pod_world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size not in (None, -1) and int(world_size) != pod_world:
        raise RuntimeError(
            f"podsim: init_process_group(world_size={world_size}) on a pod of {pod_world} "
            f"chips: podsim runs one rank per chip, so the program must ask for {pod_world} "
            f"ranks (or run on a topology of {world_size} chips)")
    if rank not in (None, -1) and int(rank) != pod_rank:
        raise RuntimeError(
            f"podsim: init_process_group(rank={rank}) in the process podsim started as rank "
            f"{pod_rank}: a program naming its ranks must give each process its RANK")


def _spawn_runs_this_rank():
    """`torch.multiprocessing.spawn(fn, args, nprocs)` and `start_processes`, how a program run
    as `python train.py` starts its ranks (pytorch/examples' `multigpu.py`), in podsim's
    processes: podsim has started one process per chip already, so with `nprocs` the host's
    chips (`torch.cuda.device_count()`) each process runs `fn(LOCAL_RANK, *args)` itself,
    once. (Spawned as asked, the children started outside podsim's interception and failed
    with "Found no NVIDIA driver".) Another count spawns as asked: helpers are not ranks."""
    import torch.multiprocessing as mp

    spawning = importlib.import_module("torch.multiprocessing.spawn")

    real_start = spawning.start_processes

    class _Ran:
        """What `join=False` returns: the rank's function has run already."""

        def join(self, timeout=None, grace_period=None):
            return True

    def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn",
                        *rest, **kwargs):
        if nprocs != int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
            return real_start(fn, args, nprocs, join, daemon, start_method, *rest, **kwargs)
        fn(int(os.environ["LOCAL_RANK"]), *args)
        return None if join else _Ran()

    def spawn(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        return start_processes(fn, args, nprocs, join, daemon, start_method)

    for module in (mp, spawning):
        module.start_processes, module.spawn = start_processes, spawn


# ---- devices -------------------------------------------------------------------------------


def _maps_to_podsim(d):
    """Whether device argument `d` names an accelerator (`"cuda"`, `"cuda:1"`, an index)."""
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True
    if isinstance(d, str):
        return d.split(":")[0] in ("cuda", "xla", "tpu")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


class DeviceMap(torch.overrides.TorchFunctionMode):
    """Turns an accelerator named in a torch call into podsim's device (data mode: the CPU).

    Meta mode's own rules (where tensors without a device go) are :class:`podsim._meta.Fake`,
    a subclass."""

    # Told of every torch call (`podsim._replay`: one function mode serves both, as each
    # costs a Python call per torch call); whether a map is on the stack.
    observer = None
    active = False
    # The map entered last (the one on the stack), and whether a replayed step may take it
    # off the stack while an optimizer steps (`podsim._replay`): a map that only renames
    # accelerators may; meta mode's, which places every new tensor, may not.
    entered = None
    can_step_aside = True

    def __init__(self, target):
        super().__init__()
        self.target = target

    def __enter__(self):
        DeviceMap.active = True
        DeviceMap.entered = self
        return super().__enter__()

    def map_device(self, d):
        return self.target if _maps_to_podsim(d) else d

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.observer is not None:
            self.observer(func, args)
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = self.map_device(kwargs["device"])
        # `Tensor.cuda` and `pin_memory` are replaced outright (`_devices_are_podsims`): of
        # the moves, only `.to(...)` reaches here.
        if getattr(func, "__name__", "") == "to" and args and isinstance(args[0], torch.Tensor):
            return self.moved(func, args, kwargs)
        return func(*args, **kwargs)

    def moved(self, func, args, kwargs):
        """`Tensor.to(...)` with any accelerator mapped."""
        if len(args) > 1 and _maps_to_podsim(args[1]):
            args = (args[0], self.target, *args[2:])
        return func(*args, **kwargs)


def _devices_are_podsims():
    target = device()
    if mode() != "meta":  # meta mode enters its own map (`podsim._meta.Fake`)
        DeviceMap(target).__enter__()
    cuda = torch.cuda
    cuda.set_device = lambda d: None
    cuda.current_device = _local_rank
    cuda.device_count = lambda: int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    # The accelerator has no generator of its own here (random ops run on the CPU's, or on
    # none in meta mode): seeding it does nothing, and its state, which a program saves and
    # restores around work (`torch.random.fork_rng`, pipelining's stage setup), is opaque
    # bytes that restoring leaves alone.
    cuda.manual_seed = lambda seed: None
    cuda.manual_seed_all = lambda seed: None
    cuda.seed = cuda.seed_all = lambda: None
    cuda.initial_seed = torch.initial_seed
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.get_rng_state_all = lambda: [torch.get_rng_state() for _ in range(cuda.device_count())]
    cuda.set_rng_state = lambda new_state, device="cuda": None
    cuda.set_rng_state_all = lambda new_states: None
    cuda.is_bf16_supported = lambda including_emulation=True: True
    cuda.get_device_name = lambda device=None: os.environ.get("PODSIM_HARDWARE", "podsim")
    _device_memory.install()
    _accelerator_is_podsims()
    torch.Tensor.pin_memory = lambda self, device=None: self
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, memory_format=None: self.to(
        target
    )
    # Autocast for an accelerator runs as the CPU's (which has bf16): the same casts. So
    # does autocast for podsim's own device, which a program names as `x.device.type`
    # ("meta" in meta mode, where torch has no autocast).
    amp_init = torch.amp.autocast_mode.autocast.__init__

    def autocast_init(self, device_type, *args, **kwargs):
        if _maps_to_podsim(device_type) or device_type == target.type:
            device_type = "cpu"
        amp_init(self, device_type, *args, **kwargs)

    torch.amp.autocast_mode.autocast.__init__ = autocast_init
    _meshes_on(target.type)
    _ddp_without_device_ids()
    _recomputation_under_the_map()


def _recomputation_under_the_map():
    """Autograd runs a backward without the torch function modes its forward ran under, so a
    function `torch.utils.checkpoint` recomputes there would hand "cuda" to torch itself (and
    in meta mode make real tensors, or fail to move one to the host): the recomputation runs
    under the rank's device map again, as its forward did."""
    import torch.utils.checkpoint as cp

    original = cp.checkpoint

    def checkpoint(function, *args, **kwargs):
        def run(*a, **k):
            mode = DeviceMap.entered
            if mode is None or mode in torch.overrides._get_current_function_mode_stack():
                return function(*a, **k)
            with mode:
                return function(*a, **k)

        return original(run, *args, **kwargs)

    # Imported by name before the rank connects, by programs and torch's checkpoint wrapper.
    _rebind.everywhere(original, checkpoint, ("checkpoint", "torch_utils_checkpoint"))


def _ddp_without_device_ids():
    """DDP's `device_ids` name GPUs; its modules are on podsim's device, for which torch
    wants none."""
    ddp = torch.nn.parallel.DistributedDataParallel
    ddp_init = ddp.__init__

    def init(self, module, device_ids=None, output_device=None, *args, **kwargs):
        ddp_init(self, module, None, None, *args, **kwargs)

    ddp.__init__ = init


def _local_rank():
    """The rank's device index, read when asked: a rank server installs these interceptions
    once, before it forks the ranks with their own environments."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def _accelerator_is_podsims():
    """`torch.accelerator` (torch's device-generic API) reports one accelerator per rank, of
    type `cuda`, which lands on podsim's device like any `cuda` device: programs that look for
    one (and exit without it) run as they would on a GPU."""
    acc = getattr(torch, "accelerator", None)
    if acc is None:
        return
    acc.is_available = lambda *a, **k: True
    acc.current_accelerator = lambda *a, **k: torch.device("cuda")
    acc.device_count = lambda: int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    acc.current_device_index = _local_rank
    acc.current_device_idx = acc.current_device_index
    acc.set_device_index = lambda device: None
    acc.set_device_idx = acc.set_device_index
    acc.device_index = lambda device: contextlib.nullcontext()
    acc.synchronize = lambda device=None: _streams.synchronize()
    acc.current_stream = _streams.current_stream
    acc.set_stream = _streams.set_stream


@contextlib.contextmanager
def _host_bookkeeping():
    """Torch ops run here are the host's bookkeeping, not the chip's kernels: uncounted."""
    rank = backend._rank
    compute = rank.compute if rank is not None else None
    was = compute.paused if compute is not None else False
    if compute is not None:
        compute.paused = True
    try:
        yield
    finally:
        if compute is not None:
            compute.paused = was


def _meshes_on(device_type):
    """Device meshes of an accelerator (or of the CPU, in meta mode) are meshes of podsim's
    device."""
    import torch.distributed.device_mesh as dm

    def mapped(args, kwargs):
        if "device_type" in kwargs:
            kwargs["device_type"] = _mesh_device(kwargs["device_type"], device_type)
        elif args:
            args = (_mesh_device(args[0], device_type), *args[1:])
        return args, kwargs

    mesh_init = dm.DeviceMesh.__init__

    def init(self, *args, **kwargs):
        args, kwargs = mapped(args, kwargs)
        # A mesh's table of ranks is bookkeeping: real values, outside meta mode's rules, and
        # no kernels of the chip (in data mode, where the chip is the CPU, each sub-mesh's
        # coordinate search was counted).
        with torch._C.DisableTorchFunction(), _host_bookkeeping():
            mesh_init(self, *args, **kwargs)

    dm.DeviceMesh.__init__ = init
    make_mesh = dm.init_device_mesh

    def init_device_mesh(*args, **kwargs):
        args, kwargs = mapped(args, kwargs)
        with torch._C.DisableTorchFunction(), _host_bookkeeping():
            return make_mesh(*args, **kwargs)

    _rebind.everywhere(make_mesh, init_device_mesh, ("init_device_mesh",))


def _mesh_device(asked, device_type):
    return device_type if _maps_to_podsim(asked) or asked == "cpu" else asked


# ---- steps and failures --------------------------------------------------------------------


def _steps_at_optimizer_steps():
    """A step ends at each `optimizer.step()` (the outermost, when one optimizer steps others),
    unless the program calls `podsim.torch.step()` itself (then its marks are the steps)."""

    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    def memory():
        """The rank's HBM count, while its ops are counted (not in a replayed step)."""
        rank = backend._rank
        if rank is None or (rank.steps is not None and not rank.steps.counting):
            return None
        return rank.compute.memory

    # Optimizers stepping inside another's step (a container of optimizers, as torchtitan
    # keeps one per model part) end one step: the outermost.
    depth = [0]

    def before_optimizer_step(optimizer, args, kwargs):
        depth[0] += 1
        # The update needs every gradient: the compute stream waits for every collective in
        # flight (DDP's buckets are waited for through futures podsim does not see).
        _streams.wait_all()
        hbm = memory()
        if hbm is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    hbm.classify(p, "parameters")
                    if p.grad is not None:
                        hbm.classify(p.grad, "gradients")
        rank = backend._rank
        if depth[0] == 1 and rank is not None and rank.steps is not None:
            # `args` holds the optimizer first, then a closure if one was given.
            closure = len(args) > 1 or kwargs.get("closure") is not None
            rank.steps.optimizer_step_begins(closure)

    def after_optimizer_step(optimizer, args, kwargs):
        depth[0] -= 1
        rank = backend._rank
        if depth[0] == 0 and rank is not None and rank.steps is not None:
            rank.steps.optimizer_step_ends()
        hbm = memory()
        if hbm is not None:
            for state in optimizer.state.values():
                for value in state.values():
                    hbm.classify(value, "optimizer state")
        if rank is not None and not rank.explicit_steps and not rank.done and depth[0] == 0:
            _streams.wait_all()
            rank.call(rank.step_request(auto=True))

    def before_forward(module, args):
        hbm = memory()
        if hbm is not None:
            for p in module._parameters.values():
                if p is not None:
                    hbm.classify(p, "parameters")

    optimizer_init = torch.optim.Optimizer.__init__

    def init(optimizer, params, defaults, *args, **kwargs):
        optimizer_init(optimizer, params, defaults, *args, **kwargs)
        hbm = memory()
        if hbm is not None:  # what it updates is the model's parameters, from now on
            for group in optimizer.param_groups:
                for p in group["params"]:
                    hbm.classify(p, "parameters")

    torch.optim.Optimizer.__init__ = init
    register_optimizer_step_pre_hook(before_optimizer_step)
    register_optimizer_step_post_hook(after_optimizer_step)
    torch.nn.modules.module.register_module_forward_pre_hook(before_forward)


def _streams_are_podsims():
    """The program's CUDA streams and FSDP2's are podsim's (`podsim._streams`)."""
    cuda = torch.cuda
    cuda.Stream, cuda.Event = _streams.Stream, _streams.Event
    cuda.current_stream, cuda.default_stream = _streams.current_stream, _streams.default_stream
    cuda.stream, cuda.set_stream = _streams.stream, _streams.set_stream
    cuda.synchronize = _streams.synchronize
    handle_of = importlib.import_module("torch.distributed.device_mesh")._get_device_handle

    def device_handle(device_type="cuda"):
        return _streams.HANDLE if device_type == "meta" else handle_of(device_type)

    def fsdp_device_handle(device_type="cuda"):
        return _streams.HANDLE if device_type in ("meta", "cpu") else handle_of(device_type)

    def patch(name, module):
        """Every module of torch.distributed holding `_get_device_handle` gets podsim's
        (FSDP2's also for its CPU-offload "cpu" handle); FSDP2 tells the allocator which
        stream uses a gradient (a CUDA stream's id): nothing to tell on podsim's device."""
        if getattr(module, "_get_device_handle", None) in (handle_of, device_handle):
            fsdp = name.startswith("torch.distributed.fsdp._fully_shard")
            module._get_device_handle = fsdp_device_handle if fsdp else device_handle
        if name == "torch.distributed.fsdp._common_utils":
            # FSDP1: its device is podsim's, whatever the program named.
            module._FSDPDeviceHandle.from_device = classmethod(lambda cls, device: _streams.HANDLE)
        if name == "torch.distributed.fsdp._init_utils":
            module._get_compute_device = lambda *args, **kwargs: DeviceMap.entered.target
        if name == "torch.distributed.fsdp._fully_shard._fsdp_collectives":
            record = module.record_grad_output_stream
            module.record_grad_output_stream = (
                lambda buffer, stream: None if buffer.device.type in ("meta", "cpu") else record(buffer, stream)
            )

    # The modules loaded so far now, the others as they load: loading FSDP and DTensor (and
    # sympy with them) up front cost every rank 0.8 s of CPU at start, for programs that
    # never use them.
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed"):
            patch(name, module)
    sys.meta_path.insert(0, _PatchOnLoad("torch.distributed.", patch))


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Calls `patch(name, module)` on each module under `prefix` as soon as it has loaded
    (Python has no post-import hook: this finder wraps the loader the others find)."""

    def __init__(self, prefix, patch):
        self.prefix, self.patch = prefix, patch

    def find_spec(self, name, path, target=None):
        if not name.startswith(self.prefix):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, lambda m: self.patch(name, m))
                return spec
        return None


class _PatchingLoader(importlib.abc.Loader):
    """`inner`, then `after(module)` once the module ran; anything else asked of it (its
    source, for `inspect` and tracebacks) is `inner`'s."""

    def __init__(self, inner, after):
        self.inner, self.after = inner, after

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.after(module)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _compile_runs_eagerly():
    """`torch.compile` gives back what it is given (a function or module, or a decorator
    that does): podsim prices a program op by op at the dispatcher, where a compiled graph's
    kernels would go unseen, and what compilation would fuse is what the `fused` eager mode
    prices as fused. A module's in-place `compile()` does nothing."""

    def compile(model=None, **options):
        if model is None:
            return compile
        if isinstance(model, torch.nn.Module) or not callable(model):
            return model

        # A function compiled at import, before podsim replaced it (`flex_attention`),
        # calls its replacement once there is one.
        @functools.wraps(model)
        def eager(*args, **kwargs):
            return _rebind.current(model)(*args, **kwargs)

        return eager

    torch.compile = compile
    torch.nn.Module.compile = lambda self, *args, **kwargs: None


def _exceptions_reach_the_chip():
    """An exception that ends the program is sent to the chip before the rank exits, so the
    report names it and its line instead of only an exit code."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        failed(f"{kind.__name__}: {value}", tb)
        previous(kind, value, tb)

    sys.excepthook = hook


def exited(exc):
    """A program that ends with `sys.exit(code)`, `code` a failure, failed as one that raised
    (`podsim._prefork` calls this): the report names the exception being handled when it
    exited - what a framework that prints a traceback and exits 1 (hydra) caught - or else
    the `sys.exit` call and its line. A rank that dies without Python's say (`os._exit`, a
    signal) is not this: its peers are left waiting, a dead worker."""
    if not _installed or exc.code in (None, 0):
        return
    cause = exc.__context__
    if isinstance(cause, Exception):
        failed(f"{type(cause).__name__}: {cause} (then sys.exit({exc.code!r}))",
               cause.__traceback__)
    else:
        failed(f"sys.exit({exc.code!r})", exc.__traceback__)


def failed(error, tb):
    """Tells the chip the program failed with `error`, at the last frame of its own in `tb`."""
    rank = backend._rank
    if rank is None or rank.done:
        return
    import traceback

    frames = traceback.extract_tb(tb)
    user = [f for f in frames if not backend.is_library_file(f.filename)]
    where = (user or frames or [None])[-1]
    site = f"{where.filename}:{where.lineno} {where.name}" if where else None
    try:
        rank.conn.send({"op": "raised", "error": error, "site": site})
    except Exception:
        pass
