"""Shape-and-dtype results of the commonest pointwise operators on meta tensors, without torch's
Python meta kernels.

torch registers Python reference implementations (``torch._refs``) as the meta kernels of most
elementwise operators; each call costs ~0.4 ms, so the pipeline split's trace of a 70B model's
80-layer forward on meta tensors spent most of its ~1.5 s in ``mul``/``add``/``pow``/``mean``/``cat``.
`fast_meta_result` (the trace's `SourceTracker` consults it before running an operator) answers
those operators directly: the output is a new contiguous meta tensor of the
broadcast shape and the promoted dtype. Anything else (integer or mixed-device inputs, in-place or
``out=`` forms, other operators) goes to torch's own kernels. Only shapes and dtypes are faster:
a meta tensor has no values, and the trace reads nothing else.
"""

from __future__ import annotations

from typing import Any

import torch

_aten = torch.ops.aten
#: (tensor, tensor-or-number) -> broadcast shape, promoted dtype
_BINARY = {_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor}
#: float tensor -> same shape and dtype
_UNARY = {
    _aten.neg.default,
    _aten.rsqrt.default,
    _aten.sqrt.default,
    _aten.exp.default,
    _aten.tanh.default,
    _aten.sigmoid.default,
    _aten.silu.default,
    _aten.gelu.default,
    _aten.relu.default,
    _aten.reciprocal.default,
}


def _is_meta_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta and value.is_floating_point()


def _meta(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _binary(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if len(args) != 2 or set(kwargs) - {"alpha"}:
        return None
    a, b = args
    if not _is_meta_float(a):
        return None
    if isinstance(b, torch.Tensor):
        if not (b.is_meta or b.dim() == 0) or not b.is_floating_point():
            return None
        shape = torch.broadcast_shapes(a.shape, b.shape)
    elif isinstance(b, int | float) and not isinstance(b, bool):
        shape = a.shape
    else:
        return None
    return _meta(shape, torch.result_type(a, b))


def _mean(args: tuple, kwargs: dict) -> torch.Tensor | None:
    a, dims = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    if not _is_meta_float(a) or kwargs.get("dtype") is not None or len(args) > 3 or not dims:
        return None
    reduced = {d % a.dim() for d in dims}
    shape = [1 if i in reduced else s for i, s in enumerate(a.shape) if keepdim or i not in reduced]
    return _meta(shape, a.dtype)


def _cat(args: tuple, kwargs: dict) -> torch.Tensor | None:
    tensors, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not tensors or not all(_is_meta_float(t) for t in tensors):
        return None
    first = tensors[0]
    dim %= max(first.dim(), 1)
    rest = [s for i, s in enumerate(first.shape) if i != dim]
    if any(t.dim() != first.dim() or [s for i, s in enumerate(t.shape) if i != dim] != rest for t in tensors):
        return None  # torch raises its own error
    dtype = first.dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return _meta(shape, dtype)


def fast_meta_result(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The meta result of `func(*args, **kwargs)` where this module knows it, else None."""
    if func in _BINARY:
        return _binary(args, kwargs)
    if func in _UNARY:
        return _meta(args[0].shape, args[0].dtype) if len(args) == 1 and _is_meta_float(args[0]) else None
    if func is _aten.pow.Tensor_Scalar:
        a, exponent = args
        if _is_meta_float(a) and isinstance(exponent, int | float) and not isinstance(exponent, bool):
            return _meta(a.shape, torch.result_type(a, exponent))
        return None
    if func is _aten.mean.dim:
        return _mean(args, kwargs)
    if func is _aten.cat.default:
        return _cat(args, kwargs)
    return None
