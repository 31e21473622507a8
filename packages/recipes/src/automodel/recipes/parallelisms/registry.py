"""The parallelisms by name, in registration order: one registration per parallelism module."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from automodel.mesh import ResolvedLayout
from automodel.recipes.parallelisms.base import ActivationSite, MemoryShares, Parallelism, RankPosition

if TYPE_CHECKING:
    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.memory import StepSetup
    from automodel.recipes.planning.shape import ModelShape

_PARALLELISMS: dict[str, Parallelism] = {}


def register_parallelism(parallelism: Parallelism) -> Parallelism:
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


def parallelisms() -> tuple[Parallelism, ...]:
    """Every registered parallelism, in registration order (the order its rules run in)."""
    return tuple(_PARALLELISMS.values())


def get_parallelism(name: str) -> Parallelism:
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


def seq_multiple(cfg: RecipeConfig, layout: ResolvedLayout) -> int:
    """The least common multiple of every parallelism's `Parallelism.seq_multiple` under `layout`:
    what a micro-batch's sequence length must be a multiple of."""
    d = cfg.distributed
    return math.lcm(*(p.seq_multiple(cfg=cfg, layout=layout, size=p.size(d, layout)) for p in parallelisms()))


def planner_sizes(section: DistributedSection, layout: ResolvedLayout) -> tuple[tuple[str, int], ...]:
    """The sizes of the registered parallelisms `StepSetup` has no field for (no mesh axis of
    that name), for `StepSetup.extra_sizes`."""
    return tuple((p.name, p.size(section, layout)) for p in _PARALLELISMS.values() if p.mesh_axis is None)


def memory_terms(
    section: DistributedSection, layout: ResolvedLayout, *, setup: StepSetup, shape: ModelShape
) -> tuple[tuple[str, float], ...]:
    """The registered parallelisms' own per-rank bytes (`Parallelism.memory_terms`), named
    ``<parallelism> <term>``, for `StepSetup.extra_bytes`."""
    return tuple(
        (f"{p.name} {name}", value)
        for p in _PARALLELISMS.values()
        for name, value in p.memory_terms(size=p.size(section, layout), setup=setup, shape=shape).items()
    )


def in_plan_order() -> tuple[Parallelism, ...]:
    """Every registered parallelism, the searched ones first in `Parallelism.search_order` (the
    order `recipes plan` and `recipes validate` print them in), then the others as registered."""
    return tuple(sorted(_PARALLELISMS.values(), key=lambda p: (p.search_order is None, p.search_order or 0)))


def searched() -> tuple[Parallelism, ...]:
    """The parallelisms `recipes plan` searches, in `Parallelism.search_order` (its table's and
    its YAML's order too)."""
    return tuple(p for p in in_plan_order() if p.search_order is not None)


def memory_shares(setup: StepSetup, shape: ModelShape) -> MemoryShares:
    """Every registered parallelism's `Parallelism.memory_shares` at once (their product)."""
    shares = MemoryShares()
    for p in _PARALLELISMS.values():
        shares = shares.times(p.memory_shares(size=setup.size_of(p.name), setup=setup, shape=shape))
    return shares


def memory_positions(setup: StepSetup) -> tuple[RankPosition, ...]:
    """The positions the memory estimate compares: the first registered parallelism's that names
    them (`Parallelism.memory_positions`), else one rank holding the whole model."""
    for p in _PARALLELISMS.values():
        positions = p.memory_positions(size=setup.size_of(p.name), setup=setup)
        if positions:
            return positions
    return (RankPosition(),)


def layer_activation_terms(
    setup: StepSetup, shape: ModelShape, *, shares: MemoryShares, moe: bool
) -> dict[ActivationSite, list[float]]:
    """The registered parallelisms' per-token activation bytes of one decoder layer, by site, in
    registration order (the order the estimate adds them in)."""
    terms: dict[ActivationSite, list[float]] = {}
    for p in _PARALLELISMS.values():
        size = setup.size_of(p.name)
        for site, value in p.layer_activation_terms(
            size=size, setup=setup, shape=shape, shares=shares, moe=moe
        ).items():
            terms.setdefault(site, []).append(value)
    return terms
