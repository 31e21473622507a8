"""Which modules a traced forward's values come from (for the pipeline split's structure trace).

A later pipeline stage replaces the modules run before the decoder layers by shape-only stand-ins,
which is right only if their outputs reach the layers through the hidden states alone (those are
handed over from the previous stage). Some models compute a value once and hand it to every layer
besides the hidden states (RoFormer's sinusoidal position table); the stage must run that module
itself. To tell them apart, `SourceTracker` labels tensors with the modules their values derive
from and carries the labels through every operator of the traced forward (meta or fake tensors,
so it costs no data). Operators that read only an input's shape (``zeros_like``, ``new_ones``, ...)
carry nothing: a mask built from the embeddings' shape does not depend on their values.

Labels travel on two channels. ``sources`` is every module a value derives from (what a module
transitively needs). ``nearest`` is reset at each module's output to that module alone, so it names
the modules whose outputs a value is computed from without passing through another module: the
values a later stage must be handed to recompute it exactly with the model's own code. While
``inside`` is set (a decoder layer runs), every value computed gets that label on the nearest
channel too, so a value one layer computes and a later one reads (a key/value cache shared across
layers) is visible.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from automodel.pipeline import torch_internals
from automodel.pipeline.torch_internals import TorchDispatchMode, tree_leaves

_aten = torch.ops.aten
#: Operators whose outputs do not depend on the values of their tensor inputs (shape, dtype, device).
_SHAPE_ONLY = {
    _aten.empty_like,
    _aten.zeros_like,
    _aten.ones_like,
    _aten.full_like,
    _aten.rand_like,
    _aten.randn_like,
    _aten.randint_like,
    _aten.new_empty,
    _aten.new_empty_strided,
    _aten.new_zeros,
    _aten.new_ones,
    _aten.new_full,
}


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors inside nested tuples, lists and dicts (e.g. a layer's ``(cos, sin)`` argument)."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class SourceTracker(TorchDispatchMode):
    """Labels tensors with the sources their values derive from, through every dispatched operator.

    Enter it innermost (after a fake-tensor mode, if any) for the duration of one forward.
    """

    def __init__(self) -> None:
        super().__init__()
        # id -> (the tensor, kept alive so the id stays its own; its labels), per channel
        self._labels: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        self._nearest: dict[int, tuple[torch.Tensor, frozenset[str]]] = {}
        #: consulted before running an operator: its result, or None to run it (a meta fast path)
        self.shortcut: Callable[[Any, tuple, dict], Any] | None = None
        #: while set, a label every computed value gets on the nearest channel (the running layer)
        self.inside: str | None = None

    def sources(self, tensors: Iterable[torch.Tensor]) -> set[str]:
        """Every label the values of `tensors` derive from."""
        return _read(self._labels, tensors)

    def nearest(self, tensors: Iterable[torch.Tensor]) -> set[str]:
        """The labels `tensors` derive from without passing through another labelled module's output."""
        return _read(self._nearest, tensors)

    def add(self, tensors: Iterable[torch.Tensor], labels: Iterable[str]) -> None:
        labels = frozenset(labels)
        for t in tensors:
            self._labels[id(t)] = (t, labels | frozenset(self.sources([t])))

    def add_nearest(self, tensors: Iterable[torch.Tensor], labels: Iterable[str]) -> None:
        labels = frozenset(labels)
        for t in tensors:
            self._nearest[id(t)] = (t, labels | frozenset(self.nearest([t])))

    def clear(self) -> None:
        self._labels.clear()
        self._nearest.clear()
        self.inside = None

    def replace(
        self, tensors: Iterable[torch.Tensor], labels: Iterable[str], *, nearest: Iterable[str] | None = None
    ) -> None:
        """Set the labels of `tensors` (and their nearest ones: `nearest`, else `labels`)."""
        labels = frozenset(labels)
        near = labels if nearest is None else frozenset(nearest)
        for t in tensors:
            self._labels[id(t)] = (t, labels)
            self._nearest[id(t)] = (t, near)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = self.shortcut(func, args, kwargs) if self.shortcut is not None else None
        if out is None:
            out = func(*args, **kwargs)
        if (
            not self._labels and not self._nearest and self.inside is None
        ) or func.overloadpacket in _SHAPE_ONLY:
            return out
        inputs = list(_op_tensors((*args, *kwargs.values())))
        labels = self.sources(inputs)
        near = self.nearest(inputs) | ({self.inside} if self.inside is not None and inputs else set())
        # An operator may hand back one of its inputs itself: that input's labels stay its own
        # (unless the operator writes into it, below).
        results = [
            t for t in _op_tensors(out if isinstance(out, tuple | list) else (out,)) if not _among(t, inputs)
        ]
        written = [t for t in _written(func, args, kwargs)]
        for channel, found in ((self.add, labels), (self.add_nearest, near)):
            if found:
                channel(results, found)
                channel(written, found)
        return out


def _among(t: torch.Tensor, tensors: list[torch.Tensor]) -> bool:
    return any(t is other for other in tensors)


def _written(func: Any, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensors an in-place or out= operator writes into, and the tensors those are views of
    (writing into a slice changes the tensor it is a slice of)."""
    values = [
        v
        for arg, v in zip(torch_internals.op_arguments(func), args)
        if arg.alias_info is not None and arg.alias_info.is_write
    ]
    values += [
        kwargs.get(arg.name)
        for arg in torch_internals.op_arguments(func)
        if arg.kwarg_only and arg.alias_info is not None and arg.alias_info.is_write
    ]
    for t in tensors_in(values):
        yield t
        base = t._base
        while base is not None:
            yield base
            base = base._base


def _read(table: dict[int, tuple[torch.Tensor, frozenset[str]]], tensors: Iterable[torch.Tensor]) -> set[str]:
    found: set[str] = set()
    for t in tensors:
        entry = table.get(id(t))
        if entry is not None and entry[0] is t:
            found |= entry[1]
    return found


def _op_tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among an operator's arguments or results (tensors, or lists of them: aten's types)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, tuple | list):
            yield from (v for v in value if isinstance(v, torch.Tensor))
