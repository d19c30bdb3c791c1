"""Meta mode for PyTorch programs: tensors with shape, dtype and device but no storage.

Torch's meta device runs every op's shape rules in C++ without touching data, so a
Llama-2-7B step under FSDP2 on a 4,096-rank mesh takes about two seconds here (torch's
``FakeTensorMode``, which wraps each tensor and dispatches in Python, took 93 s). The rules:

- a tensor made without data (``zeros``, ``empty``, ``randn``, a module's parameters) is a meta
  tensor, on whatever device the program names; so is a tensor of real data moved to a device
  (``batch.to("cuda")``);
- 0-dimensional tensors keep real values on the CPU (an optimizer's step count, a loss scale):
  bookkeeping that divides by ``1 - beta**step`` must see a real step, and a 0-d CPU tensor
  mixes with tensors of any device;
- integer tensors made on the CPU (up to ``HOST_INTEGERS`` elements) keep real values too:
  the host's own work, such as a batch's random offsets into a token file
  (``data[i:i + block_size]`` with ``i`` from ``torch.randint``) or a sampler's permutation,
  which with stand-in values would cut empty batches and price a model on no tokens;
- tensors made from data (``torch.tensor(list)``, ``from_numpy``) stay real until moved;
- what needs a value of a meta tensor (``.item()``, ``print(loss)``, ``if x > 0``,
  ``torch.save``) gets a stand-in: numbers are 1 (divides safely, a valid size), truth values
  ``False`` (the branch a healthy run takes past a NaN check), text ``<meta>``, a save writes
  nothing. Each use is counted with its line, and the report lists them;
- sizes that are data (``nonzero``, ``torch.where(mask)``, ``x[mask]``) get stand-ins too
  (``podsim._meta_shapes``), and so do counts a router makes (``podsim._meta_counts``).

DDP runs with its C++ reducer stood in for (:mod:`podsim._meta_ddp`). FSDP2 and DTensor see a
device mesh of the meta device: three of FSDP2's device checks
(its device handle, its refusal of meta parameters, its CUDA stream bookkeeping) are bridged
here, since on the meta device they have nothing to check.
"""

import collections
import contextlib
import sys

import torch

from . import _functional, _meta_autocast, _meta_counts, _meta_ddp, _meta_objects, _meta_shapes
from . import _rebind
from . import torch as backend
from ._intercept import DeviceMap, _maps_to_podsim

META = torch.device("meta")

# Stand-ins given, by (what, `file:line function`).
stand_ins = collections.Counter()

# Factories that make a tensor from data: their result stays real until it is moved.
_FROM_DATA = {"tensor", "as_tensor", "asarray", "from_numpy", "frombuffer", "scalar_tensor"}


def _is_factory(func):
    from torch.utils._device import _device_constructors

    global _FACTORIES
    if _FACTORIES is None:
        _FACTORIES = {f for f in _device_constructors() if f.__name__ not in _FROM_DATA}
    return func in _FACTORIES


_FACTORIES = None


class Fake(DeviceMap):
    """Meta mode's device map: large tensors land on the meta device, whatever device the
    program names; 0-d tensors stay real."""

    can_step_aside = False

    def __init__(self):
        super().__init__(META)

    def map_device(self, d):
        return META

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _meta_shapes.FUNCTIONS:
            out = _meta_shapes.stand_in(func, args, kwargs or {})
            if out is not NotImplemented:
                if isinstance(out, _meta_shapes.Read):
                    out = out.out
                else:
                    stand_ins[(f"{func.__name__} (its size)", _site())] += 1
                _meta_counts.carry(func, args, kwargs or {}, out)
                return out
        out = self._run(func, args, kwargs or {})
        if func is torch.Tensor.__setitem__:
            _meta_counts.forget(args[0])  # written in place; it returns nothing
        elif func in _meta_counts.RULES or (type(out) is torch.Tensor and (
                not out.is_floating_point() or _meta_counts.values_of(out) is not None)):
            _meta_counts.carry(func, args, kwargs or {}, out)
        return out

    def _run(self, func, args, kwargs):
        if isinstance(func, torch._ops.OpOverload):
            # An aten op called from a dispatch mode's handler (podsim's count, autograd's
            # checkpoint): what it was asked for was placed already, and a host tensor it
            # makes (a byte tensor a legacy constructor fills from a storage) stays there.
            # Only an accelerator it names is podsim's.
            if _maps_to_podsim(kwargs.get("device")):
                kwargs["device"] = META
            return func(*args, **kwargs)
        args, kwargs = _meta_autocast.casts(func, args, kwargs)
        name = getattr(func, "__name__", "")
        if _is_factory(func):
            asked = kwargs.get("device")
            asked_meta = _is_meta(asked) and not _from_fsdp()
            kwargs["device"] = META
            with _untracked(asked_meta):
                out = func(*args, **kwargs)
            if out.dim() == 0 or _host_integers(asked, out):  # keeps its values
                kwargs["device"] = "cpu"
                return func(*args, **kwargs)
            return out
        # `Tensor.cuda` and `pin_memory` are replaced outright (`podsim._intercept`).
        if name in ("to", "cpu") and args and isinstance(args[0], torch.Tensor):
            return _moved(func, args, kwargs)
        if (name in _FROM_DATA and kwargs.get("device") is not None
                and not (args and isinstance(args[0], torch.Tensor))):
            # Data put on the device: made on the host, then moved (keeping small values),
            # a leaf as asked.
            kwargs["device"] = "cpu"
            grad = kwargs.pop("requires_grad", False)
            out = _moved(torch.Tensor.to, (func(*args, **kwargs), META), {})
            return out.requires_grad_() if grad else out
        if "device" in kwargs:
            kwargs["device"] = META
        return func(*args, **kwargs)


# The most elements an integer tensor made on the CPU keeps real (a sampler's permutation of
# 16 million samples is 128 MB of the host's memory).
HOST_INTEGERS = 1 << 24


def _host_integers(asked, out):
    """Whether factory result `out` (made on the meta device, `asked` for `asked`) is integer
    data the host makes for itself: asked on the CPU, not floating point, not too large."""
    if out.is_floating_point() or out.is_complex() or out.numel() > HOST_INTEGERS:
        return False
    device = torch.device(asked) if asked is not None else torch.get_default_device()
    return device.type == "cpu"


def _is_meta(device):
    return device is not None and torch.device(device).type == "meta"


# Frames between a factory's caller and `_run`: this mode's entry and torch's dispatch.
_FACTORY_CALLER_DEPTH = 8


def _from_fsdp():
    """Whether FSDP's own code made the factory call. Its device is the mesh's, which is the
    meta device in meta mode, so a `torch.empty(..., device=meta)` of its (an unsharded
    parameter, a gather's output, a reduce-scatter's input) is the chip's memory, where the
    same call in the program (`with torch.device("meta")`: deferred initialisation) is not."""
    frame = sys._getframe(2)
    for _ in range(_FACTORY_CALLER_DEPTH):
        if frame is None:
            return False
        if "torch/distributed/fsdp/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def _untracked(really):
    """Tensors made inside are not the chip's memory (the program asked for meta tensors)."""
    rank = backend._rank
    memory = rank.compute.memory if really and rank is not None else None
    if memory is not None:
        memory.untracked += 1
    try:
        yield
    finally:
        if memory is not None:
            memory.untracked -= 1


def _moved(func, args, kwargs):
    """`t.to(...)`, `t.cpu()`: a tensor asked onto any device lands on the meta device,
    unless it is a real 0-d tensor (bookkeeping keeps its value); a dtype alone changes the
    dtype where the tensor is."""
    t, rest = args[0], list(args[1:])
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    if func.__name__ == "cpu":
        device, rest = "cpu", []
    elif rest and isinstance(rest[0], torch.Tensor):
        device, dtype = rest[0].device, rest[0].dtype
        rest = rest[1:]
    elif rest and isinstance(rest[0], torch.dtype):
        dtype, rest = rest[0], rest[1:]
    elif rest and (rest[0] is None or isinstance(rest[0], (str, int, torch.device))):
        device, rest = rest[0], rest[1:]
        # `to(device, dtype, non_blocking)`, the dtype possibly None (`Module.to` passes it).
        if rest and (rest[0] is None or isinstance(rest[0], torch.dtype)):
            dtype, rest = rest[0], rest[1:]
    for key, value in zip(("non_blocking", "copy"), rest):
        kwargs[key] = value
    if device is not None and (t.is_meta or t.dim() > 0):
        kwargs["device"] = META
    if dtype is not None:
        kwargs["dtype"] = dtype
    out = torch.Tensor.to(t, **kwargs) if kwargs else t
    if out.is_meta and not t.is_meta:
        _meta_counts.keep_values(out, t)
    return out


def _site():
    frame = sys._getframe(2)
    while frame is not None and backend.is_library_file(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "an unknown line"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"


def _stand_in(method, value):
    """`method` of torch.Tensor, returning `value(tensor)` for meta tensors."""
    real = getattr(torch.Tensor, method)

    def patched(self, *args, **kwargs):
        if self.is_meta:  # a DTensor on a meta mesh too
            counted = _meta_counts.mean_of(self) is not None and not self.is_floating_point()
            what = method
            if _meta_counts.values_of(self) is not None:
                what = f"{method} (values moved to the device, alike on every rank)"
            elif counted:
                what = f"{method} (balanced counts)"
            stand_ins[(what, _site())] += 1
            return value(self, *args, **kwargs)
        return real(self, *args, **kwargs)

    patched.__name__ = method
    setattr(torch.Tensor, method, patched)


def _number(t, *args, **kwargs):
    known = _ones(t) if t.numel() == 1 else None
    if known is not None:
        return known.reshape(()).item()
    return 1.0 if t.dtype.is_floating_point else 1


def _ones(t):
    """Real values for `t`, on the CPU (made outside meta mode's rules): its known values or
    balanced counts when it carries them (`podsim._meta_counts`), else ones of its shape and
    dtype."""
    known = _meta_counts.values_of(t)
    if known is None and not t.is_floating_point():
        known = _meta_counts.balanced(t)
    if known is not None:
        return known.clone()
    with torch._C.DisableTorchFunction():
        return torch.ones(t.shape, dtype=t.dtype)


def _values_get_stand_ins():
    _stand_in("item", _number)
    _stand_in("__float__", lambda t: 1.0)
    _stand_in("__int__", lambda t: int(_number(t)))
    _stand_in("__index__", lambda t: int(_number(t)))
    _stand_in("__bool__", lambda t: False)
    _stand_in("tolist", lambda t: _ones(t).tolist())
    _stand_in("__format__", lambda t, spec: format(_number(t), spec) if t.dim() == 0 else "<meta>")
    _stand_in("__repr__", lambda t, **kw: f"tensor(<meta>, size={tuple(t.shape)}, dtype={t.dtype})")
    _stand_in("numpy", lambda t, **kw: _ones(t).numpy())
    save = torch.save

    def no_save(obj, f, *args, **kwargs):
        stand_ins[("torch.save", _site())] += 1

    no_save.__wrapped__ = save
    torch.save = no_save


def _fsdp_on_the_meta_device():
    """The parameters of a meta-mode program are meta tensors for good: FSDP2's check that
    they were materialised has nothing to check (its device handle and stream bookkeeping
    are podsim's streams: `podsim._intercept`). FSDP2 cuts each parameter into one piece per
    rank to keep one: at 110,592 ranks that is 110,592 tensors per parameter, minutes per
    layer; the pieces are made when asked for instead (the same views). FSDP1 would
    materialise meta parameters (`reset_parameters`, a `param_init_fn`): there are no values
    to give them."""
    from torch.distributed.fsdp import _init_utils
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param, _fsdp_param_group

    _fsdp_param_group.FSDPParamGroup._validate_no_meta_params = lambda self: None
    _fsdp_param_group.FSDPParamGroup._validate_cpu_offload_params = _cpu_offload_refused
    _init_utils._need_to_materialize_module = lambda *args, **kwargs: (False, False)
    _fsdp_common._chunk_with_empty = _LazyChunks
    _fsdp_param._chunk_with_empty = _LazyChunks


def _cpu_offload_refused(group):
    """FSDP2's CPU offload in meta mode: its shards would live in host memory and cross PCIe
    every step, and here they would be counted as HBM with no transfer priced; refused by
    name instead of torch's "should be materialized on CPU"."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if isinstance(group.offload_policy, CPUOffloadPolicy):
        raise NotImplementedError(
            "podsim: meta mode does not model FSDP2's CPU offload (offload_policy="
            "CPUOffloadPolicy()): host-resident shards and their PCIe copies are not counted. "
            "Run it without the offload policy (HBM then holds the shards), or in data mode")


class _LazyChunks:
    """`torch.chunk(tensor, n, dim)` padded with empty tensors to `n` pieces (FSDP2's
    `_chunk_with_empty`), each piece made when indexed."""

    def __init__(self, tensor, num_chunks, dim):
        self.tensor, self.n, self.dim = tensor, num_chunks, dim
        self.size = -(-tensor.size(dim) // num_chunks) if tensor.dim() else 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        start = i * self.size
        length = min(self.size, self.tensor.size(self.dim) - start)
        if length <= 0:
            # Past the data (as torch.chunk pads them): empty; the first is the empty slice.
            return self.tensor.narrow(self.dim, 0, 0) if i == 0 else self.tensor.new_empty(0)
        return self.tensor.narrow(self.dim, start, length)

    def __iter__(self):
        return (self[i] for i in range(self.n))


def _multi_tensor_kernels_on_the_meta_device():
    """torch's multi-tensor kernels (`_foreach_*`, and the fused optimizers') have meta
    implementations, but torch offers them only on the devices it lists (the CPU and the
    accelerators): a program that asks for them (`clip_grad_norm_(foreach=True)`,
    `AdamW(fused=True)`, as on a GPU) gets them on the meta device too, and an optimizer left
    to choose picks them there as it does in data mode on the CPU."""
    import torch.utils._foreach_utils as foreach

    for name in ("_get_foreach_kernels_supported_devices", "_get_fused_kernels_supported_devices"):
        listed = getattr(foreach, name)

        def supported(listed=listed):
            return [*listed(), "meta"]

        setattr(foreach, name, supported)
        _rebind.everywhere(listed, supported, (name,))


def install():
    _fsdp_on_the_meta_device()
    _multi_tensor_kernels_on_the_meta_device()
    _values_get_stand_ins()
    _meta_autocast.install()
    _functional.install()
    _meta_ddp.install()
    _meta_objects.install(lambda what: stand_ins.update([(what, _site())]))
    Fake().__enter__()
