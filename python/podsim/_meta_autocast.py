"""Autocast in meta mode: the casts torch's autocast makes on an accelerator, made for meta
tensors, which no autocast of torch's reaches (autocast acts by a tensor's device, and the
meta device has none).

A program's ``torch.autocast("cuda", dtype=torch.bfloat16)`` runs as the CPU's autocast
(``podsim._intercept``), whose state says what is on. Inside it, the ops CUDA's autocast runs
in the low precision (matrix products, convolutions, attention) get their floating-point
arguments in its dtype, and those it runs in float32 (softmax, norms, losses, exp and log)
in float32, as torch's ``autocast_mode.cpp`` lists them for CUDA. A parameter is cast once
per autocast region, as torch's cast cache does, and its low-precision copy is held until the
region ends: HBM a real chip holds too. Without this, a meta-mode program under autocast ran
every matmul in float32: twice the activations' HBM, and the MXU priced at float32.
"""

import weakref

import torch
import torch.nn.functional as F

# The casts of parameters made in the current autocast region: id -> (parameter, its cast).
_cache = {}


def _functions(owner, names):
    return {getattr(owner, n) for n in names if hasattr(owner, n)}


_PRODUCTS = ("matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv", "addr",
             "einsum", "chain_matmul", "prelu")
_LOW_PRECISION = (
    _functions(torch, _PRODUCTS)
    | _functions(torch.Tensor, (*_PRODUCTS, "__matmul__", "__rmatmul__"))
    | _functions(torch.linalg, ("multi_dot", "vecdot"))
    | _functions(F, ("linear", "bilinear", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                     "conv_transpose2d", "conv_transpose3d", "scaled_dot_product_attention"))
)

_FLOAT32_MATH = ("exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "pow",
                 "acos", "asin", "cosh", "sinh", "tan", "erfinv", "softmax", "log_softmax",
                 "logsumexp", "cumsum", "cumprod", "prod", "sum", "norm", "dist", "cdist",
                 "renorm")
_FLOAT32 = (
    _functions(torch, _FLOAT32_MATH)
    | _functions(torch.Tensor, _FLOAT32_MATH)
    | _functions(F, ("softmax", "log_softmax", "softplus", "layer_norm", "group_norm",
                     "cosine_similarity", "cross_entropy", "nll_loss", "kl_div", "l1_loss",
                     "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
                     "binary_cross_entropy_with_logits", "poisson_nll_loss", "soft_margin_loss",
                     "multilabel_margin_loss", "multi_margin_loss", "triplet_margin_loss",
                     "hinge_embedding_loss", "cosine_embedding_loss", "pdist"))
    | _functions(torch.linalg, ("vector_norm", "matrix_norm"))
)


def casts(func, args, kwargs):
    """`(args, kwargs)` for `func` as autocast would hand them to it: cast when an autocast
    region is on and `func` is one it casts for; unchanged otherwise."""
    if func in _LOW_PRECISION:
        if not torch.is_autocast_enabled("cpu"):
            return args, kwargs
        dtype = torch.get_autocast_dtype("cpu")
    elif func in _FLOAT32:
        if not torch.is_autocast_enabled("cpu") or kwargs.get("dtype") is not None:
            return args, kwargs
        dtype = torch.float32
    else:
        return args, kwargs
    cast = [_cast(a, dtype) for a in args]
    # An `out=` buffer is the caller's: written as it is.
    return cast, {k: v if k == "out" else _cast(v, dtype) for k, v in kwargs.items()}


def _cast(x, dtype):
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    eligible = (isinstance(x, torch.Tensor) and x.is_floating_point()
                and x.dtype not in (dtype, torch.float64))
    if not eligible:
        return x
    if not (x.is_leaf and x.requires_grad):
        return x.to(dtype)
    kept = _cache.get(id(x))
    if kept is not None and kept[0]() is x and kept[1].dtype == dtype:
        return kept[1]
    low = x.to(dtype)
    _cache[id(x)] = (weakref.ref(x), low)
    return low


def install():
    """Casts of parameters are dropped when the outermost autocast region ends, as torch
    drops its cache."""
    autocast = torch.amp.autocast_mode.autocast
    leave = autocast.__exit__

    def exit_(self, *args):
        out = leave(self, *args)
        if not torch.is_autocast_enabled("cpu"):
            _cache.clear()
        return out

    autocast.__exit__ = exit_
