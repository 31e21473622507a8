"""The parallelisms by name, in registration order: one registration per parallelism module."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from automodel.mesh import ResolvedLayout
from automodel.recipes.parallelisms.base import C, Parallelism

if TYPE_CHECKING:
    from automodel.recipes.config.distributed import DistributedSection

#: Each parallelism over its own config class: `Parallelism[Any]`.
_PARALLELISMS: dict[str, Parallelism[Any]] = {}


def register_parallelism(parallelism: Parallelism[C]) -> Parallelism[C]:
    """Make `parallelism` part of every ``distributed:`` section (its size key, rules, terms, line)."""
    if parallelism.name in _PARALLELISMS:
        raise ValueError(f"parallelism {parallelism.name!r} is registered twice")
    if any(p.size_key == parallelism.size_key for p in _PARALLELISMS.values()):
        raise ValueError(f"parallelism {parallelism.name!r}: size key {parallelism.size_key!r} is taken")
    _PARALLELISMS[parallelism.name] = parallelism
    return parallelism


def unregister_parallelism(name: str) -> None:
    """Remove a registered parallelism (tests that register a toy one)."""
    del _PARALLELISMS[name]


def parallelisms() -> tuple[Parallelism[Any], ...]:
    """Every registered parallelism, in registration order (the order its rules run in)."""
    return tuple(_PARALLELISMS.values())


def get_parallelism(name: str) -> Parallelism[Any]:
    """The registered parallelism `name`; KeyError for an unknown one."""
    return _PARALLELISMS[name]


def size_keys() -> tuple[str, ...]:
    """Every ``distributed.<size key>``, in registration order."""
    return tuple(p.size_key for p in _PARALLELISMS.values())


def section_keys() -> tuple[str, ...]:
    """Every parallelism's own options section (``pipeline``, ``moe``)."""
    return tuple(p.section_key for p in _PARALLELISMS.values() if p.section_key is not None)


def axis_sizes(section: DistributedSection, layout: ResolvedLayout) -> dict[str, int]:
    """Every mesh axis's size, and every registered parallelism's by its name (the layout report's
    `axis_sizes`)."""
    sizes = {axis: layout.axis_size(axis) for axis in layout.axis_names()}
    sizes.update({p.name: p.size(section, layout) for p in _PARALLELISMS.values()})
    return sizes


def in_plan_order() -> tuple[Parallelism[Any], ...]:
    """Every registered parallelism, the searched ones first in `Parallelism.search_order` (the
    order `recipes plan` and `recipes validate` print them in), then the others as registered."""
    return tuple(sorted(_PARALLELISMS.values(), key=lambda p: (p.search_order is None, p.search_order or 0)))


def in_apply_order() -> tuple[Parallelism[Any], ...]:
    """The parallelisms applied to each model part before the data-parallel sharding, in
    `Parallelism.apply_phase` order (the composition's documented order: TP -> CP -> EP)."""
    phased = [p for p in _PARALLELISMS.values() if p.apply_phase is not None]
    return tuple(sorted(phased, key=lambda p: p.apply_phase or 0))


def searched() -> tuple[Parallelism[Any], ...]:
    """The parallelisms `recipes plan` searches, in `Parallelism.search_order` (its table's and
    its YAML's order too)."""
    return tuple(p for p in in_plan_order() if p.search_order is not None)
