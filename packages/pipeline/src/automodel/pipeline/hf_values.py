"""The values the split's meta-tensor trace knows: those of its own inputs and what follows from them.

A meta tensor has no values, but the trace chooses its inputs (token ids, position ids ``0..n-1``)
and a model's forward asks questions of them that decide which code runs: transformers asks whether
the position ids hold packed sequences and whether a padding mask is all ones, and without a mask
it hands the attention no mask at all (sdpa's causal flag, native GQA). Refusing those questions
(``Tensor.item() cannot be called on meta tensors``) sent the trace to another path than the run:
a materialized mask, repeated key/value heads, and models the run trains could not be split.
`KnownValues` computes, on the CPU, every result whose inputs all have known values (small ones:
index arithmetic, not activations) and answers a read of such a value (``.item()``, ``bool()``) as
the run would; a read of anything else still fails as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from automodel.pipeline import torch_internals
from automodel.pipeline.torch_internals import TorchDispatchMode, tree_map_only

_aten = torch.ops.aten
#: Operators that read a value out of a tensor (``.item()``, ``bool()``, ``torch.equal``).
_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default}
#: Factories whose values are uninitialized memory: never known.
_UNINITIALIZED = {
    _aten.empty.memory_format,
    _aten.empty_strided.default,
    _aten.empty_like.default,
    _aten.new_empty.default,
}
#: Results larger than this are not computed (activations are never known anyway: weights are not).
MAX_KNOWN_ELEMENTS = 1 << 16


class KnownValues(TorchDispatchMode):
    """A dispatch mode that keeps a CPU copy of the values of meta tensors computed from known ones.

    Enter it innermost, over a forward on meta tensors; `know` the inputs whose values the caller
    chose first. Random operators and those with an unknown input give unknown results.
    """

    def __init__(self) -> None:
        super().__init__()
        # id -> (the meta tensor, kept alive so the id stays its own; its value on the CPU)
        self._values: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def know(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """`tensor` (meta) holds `value` (same shape and dtype, on the CPU)."""
        assert tensor.shape == value.shape and tensor.dtype == value.dtype, (tensor, value)
        self._values[id(tensor)] = (tensor, value)

    def value(self, tensor: torch.Tensor) -> torch.Tensor | None:
        entry = self._values.get(id(tensor))
        return entry[1] if entry is not None and entry[0] is tensor else None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in _tensors((*args, *kwargs.values())) if t.is_meta]
        known = all(self.value(t) is not None for t in tensors)
        if func in _READS and tensors and known:
            return func(*_on_cpu(args, self), **_on_cpu(kwargs, self))
        out = func(*args, **kwargs)
        if func in _READS:
            return out
        if not known or func in _UNINITIALIZED or torch.Tag.nondeterministic_seeded in func.tags:
            self._forget(_written(func, args, kwargs))
            return out
        results = [t for t in _tensors(out if isinstance(out, tuple | list) else (out,)) if t.is_meta]
        if not results or any(r.numel() > MAX_KNOWN_ELEMENTS for r in results):
            self._forget(_written(func, args, kwargs))
            return out
        if not tensors and not any(isinstance(v, torch.device) and v.type == "meta" for v in kwargs.values()):
            return out  # a factory of another device than meta: nothing to mirror
        cpu_kwargs = {
            k: (torch.device("cpu") if isinstance(v, torch.device) else v) for k, v in kwargs.items()
        }
        value = func(*_on_cpu(args, self), **_on_cpu(cpu_kwargs, self))
        values = [v for v in _tensors(value if isinstance(value, tuple | list) else (value,))]
        for meta, cpu in zip(results, values, strict=False):
            if meta.shape == cpu.shape and meta.dtype == cpu.dtype:
                self.know(meta, cpu)
        return out

    def _forget(self, tensors: Iterable[torch.Tensor]) -> None:
        """An operator with unknown inputs wrote into these: their values are no longer known, nor
        those of the tensors sharing their memory (views, bases)."""
        storages = set()
        for t in tensors:
            value = self.value(t)
            if value is not None:
                storages.add(value.untyped_storage().data_ptr())
            self._values.pop(id(t), None)
        if storages:
            self._values = {
                k: (meta, cpu)
                for k, (meta, cpu) in self._values.items()
                if cpu.untyped_storage().data_ptr() not in storages
            }


def _tensors(values: Iterable[Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, tuple | list):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


def _on_cpu(tree: Any, known: KnownValues) -> Any:
    """`tree` with each meta tensor replaced by its known CPU value (callers checked they are known)."""

    def swap(value: torch.Tensor) -> torch.Tensor:
        if not value.is_meta:
            return value
        cpu = known.value(value)
        assert cpu is not None
        return cpu

    return tree_map_only(torch.Tensor, swap, tree)


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an in-place or ``out=`` operator writes into (by its schema)."""
    written = []
    for i, arg in enumerate(torch_internals.op_arguments(func)):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        written.extend(_tensors([value]))
    return written
