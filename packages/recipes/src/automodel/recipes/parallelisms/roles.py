"""Mesh roles: which mesh axes the loop reduces over, read off the registered parallelisms' flags
instead of named by the loop (as torchtitan's `ParallelDims` answers roles, not axis names).

A parallelism whose mesh axis splits each batch's rows (`Parallelism.splits_rows`: data
parallelism) sets the batch rank and the ranks the label-token count sums over; one that splits
each row's tokens (`splits_tokens`: context parallelism) joins them for the loss sum; one whose
ranks hold different plain parameters (`holds_distinct_parameters`: the pipeline's stages) sums the
gradient norm. The sequence length must be a multiple of every one's `sequence_divisor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

from automodel.mesh import MeshContext, ResolvedLayout, axes, dense_axes
from automodel.recipes.parallelisms.registry import parallelisms

if TYPE_CHECKING:
    from automodel.recipes.config.distributed import DistributedSection


@dataclass(frozen=True)
class MeshRoles:
    """The mesh axes of each role, in the dense mesh's order (outermost first)."""

    #: Axes that split the rows of a batch: this rank's batch share, and the label-token count's sum.
    batch_axes: tuple[str, ...]
    #: Axes whose ranks hold different parts of the loss (the rows' and the tokens' splits).
    loss_axes: tuple[str, ...]
    #: Axes whose ranks hold different plain (not DTensor) parameters: the gradient norm's sum.
    norm_axes: tuple[str, ...]
    #: Row-splitting axes whose ranks hold whole copies of a sharding strategy's state (HSDP's).
    copy_axes: tuple[str, ...] = ()


def _axes(flag: str) -> tuple[str, ...]:
    flagged = {p.mesh_axis for p in parallelisms() if p.mesh_axis is not None and getattr(p, flag)}
    return tuple(a for a in dense_axes() if a in flagged)


def mesh_roles() -> MeshRoles:
    """The roles of the registered parallelisms' mesh axes."""
    rows = _axes("splits_rows")
    tokens = _axes("splits_tokens")
    return MeshRoles(
        batch_axes=rows,
        loss_axes=tuple(a for a in dense_axes() if a in rows or a in tokens),
        norm_axes=_axes("holds_distinct_parameters"),
        copy_axes=_axes("holds_whole_copies"),
    )


def shard_axis(*, over_copies: bool) -> str:
    """The flattened mesh axis of the table a data-parallel strategy's sharded state spans: the
    axes that split the rows (`MeshRoles.batch_axes`, but for the `MeshRoles.copy_axes` unless
    `over_copies`) and every axis whose ranks hold parameter replicas (`Axis.spans_replicas`: cp,
    whose gradients are summed with the rows'). FSDP2 shards inside the copies (``dp_shard_cp``),
    megatron-fsdp over every row-splitting axis (``dp_cp``)."""
    roles = mesh_roles()
    rows = {a for a in roles.batch_axes if over_copies or a not in roles.copy_axes}
    for row in axes():
        if row.mesh == "flattened" and row.spans_replicas and set(row.spans) == rows:
            return row.name
    raise ValueError(f"the axis table has no flattened axis spanning {sorted(rows)} and the replica axes")


def role_group(mesh: MeshContext, axes: tuple[str, ...]) -> dist.ProcessGroup | None:
    """The process group spanning `axes` of this rank (None: they hold one rank), whichever axes a
    parallelism flagged (`MeshContext.mesh_over`: a dense or flattened axis, else one made once)."""
    spanning = mesh.mesh_over(axes)
    return None if spanning is None else spanning.get_group()


def batch_ranks(layout: ResolvedLayout) -> int:
    """How many ranks split each batch's rows (the data-parallel size: the product of the
    `MeshRoles.batch_axes`)."""
    return math.prod(layout.axis_size(a) for a in mesh_roles().batch_axes)


def batch_rank(mesh: MeshContext, axes: tuple[str, ...]) -> int:
    """This rank's index among the ranks that split the batch (row-major over `axes`)."""
    coordinates = mesh.coordinates
    index = 0
    for axis in axes:
        index = index * mesh.layout.axis_size(axis) + coordinates[axis]
    return index


def sequence_length_divisor(section: DistributedSection, layout: ResolvedLayout) -> int:
    """What every sequence length of this layout must be a multiple of: the least common multiple
    of each parallelism's `Parallelism.sequence_divisor` (2 * cp for load-balanced context
    parallelism; cp * tp for sequence parallelism across pipeline stages; 1 without either)."""
    divisor = 1
    for p in parallelisms():
        divisor = math.lcm(
            divisor, p.sequence_divisor(section=section, layout=layout, size=p.size(section, layout))
        )
    return divisor
