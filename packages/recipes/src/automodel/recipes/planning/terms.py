"""The parallelisms' planner terms folded over the registry: what `planning.memory` and
`recipes validate` add up (each parallelism's own terms are its hooks, `parallelisms.base`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from automodel.mesh import ResolvedLayout, flattened_axes
from automodel.recipes.parallelisms import (
    ActivationSite,
    MemoryShares,
    RankPosition,
    mesh_roles,
    parallelisms,
    shard_axis,
)
from automodel.recipes.planning.shape import ModelShape
from automodel.recipes.planning.step import StepSetup, StrategyMemory

if TYPE_CHECKING:
    from automodel.recipes.config.distributed import DistributedSection


def planner_sizes(section: DistributedSection, layout: ResolvedLayout) -> tuple[tuple[str, int], ...]:
    """The sizes of the registered parallelisms that form no mesh axis (the layout holds the
    others), for `StepSetup.sizes`."""
    return tuple((p.name, p.size(section, layout)) for p in parallelisms() if p.mesh_axis is None)


def memory_terms(
    section: DistributedSection, layout: ResolvedLayout, *, setup: StepSetup, shape: ModelShape
) -> tuple[tuple[str, float], ...]:
    """The registered parallelisms' own per-rank bytes (`Parallelism.memory_terms`), named
    ``<parallelism> <term>``, for `StepSetup.extra_bytes`."""
    return tuple(
        (f"{p.name} {name}", value)
        for p in parallelisms()
        for name, value in p.memory_terms(size=p.size(section, layout), setup=setup, shape=shape).items()
    )


def memory_shares(setup: StepSetup, shape: ModelShape) -> MemoryShares:
    """Every registered parallelism's `Parallelism.memory_shares` at once (their product)."""
    shares = MemoryShares()
    for p in parallelisms():
        shares = shares.times(p.memory_shares(size=setup.size_of(p.name), setup=setup, shape=shape))
    return shares


def memory_positions(setup: StepSetup) -> tuple[RankPosition, ...]:
    """The positions the memory estimate compares: the first registered parallelism's that names
    them (`Parallelism.memory_positions`), else one rank holding the whole model."""
    for p in parallelisms():
        positions = p.memory_positions(size=setup.size_of(p.name), setup=setup)
        if positions:
            return positions
    return (RankPosition(),)


def batch_ranks_of(setup: StepSetup) -> int:
    """The ranks that split each batch's rows in `setup` (the data-parallel size: the product of
    the mesh roles' batch axes, `parallelisms.roles.mesh_roles`)."""
    return math.prod(setup.size_of(a) for a in mesh_roles().batch_axes)


def shard_axis_of(sharding: StrategyMemory) -> str | None:
    """The flattened mesh axis a strategy's `StrategyMemory.shard_over` is (`roles.shard_axis`);
    None for ``none`` (replicated)."""
    if sharding.shard_over == "none":
        return None
    return shard_axis(over_copies=sharding.shard_over == "rows")


def shard_ranks(setup: StepSetup, sharding: StrategyMemory) -> int:
    """The ranks a strategy shards its state over in `setup` (`shard_axis_of`); 1 when replicated."""
    axis = shard_axis_of(sharding)
    return 1 if axis is None else math.prod(setup.size_of(a) for a in flattened_axes()[axis])


def expert_shard_ranks(setup: StepSetup) -> int | None:
    """The ranks the split-off experts' weights are sharded over: the first registered
    parallelism's that names them (`Parallelism.expert_shard_ranks`), None: with the dense ones."""
    for p in parallelisms():
        ranks = p.expert_shard_ranks(size=setup.size_of(p.name), setup=setup)
        if ranks is not None:
            return ranks
    return None


def layer_activation_terms(
    setup: StepSetup, shape: ModelShape, *, shares: MemoryShares, moe: bool
) -> dict[ActivationSite, list[float]]:
    """The registered parallelisms' per-token activation bytes of one decoder layer, by site, in
    registration order (the order the estimate adds them in)."""
    terms: dict[ActivationSite, list[float]] = {}
    for p in parallelisms():
        size = setup.size_of(p.name)
        for site, value in p.layer_activation_terms(
            size=size, setup=setup, shape=shape, shares=shares, moe=moe
        ).items():
            terms.setdefault(site, []).append(value)
    return terms
