"""The mesh axes, in one table: each axis's name, the YAML size key that sizes it, its mesh and
its place in it, and the dense axes a flattened axis spans.

Every list of axes elsewhere (the dense mesh's dims, the flattened dims, the MoE mesh, the axes a
layout line or a checkpoint's layout names) is read off `AXES`, so an axis is added here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: Which mesh an axis belongs to: the dense device mesh, a flattening of dense axes, or the MoE mesh
#: (one per tp coordinate).
MeshKind = Literal["dense", "flattened", "moe"]


@dataclass(frozen=True)
class Axis:
    """One mesh axis."""

    #: The mesh dim name (`MeshContext.get_mesh`, `ResolvedLayout.axis_size`).
    name: str
    mesh: MeshKind
    #: The ``distributed.<size_key>`` YAML key that sizes it; None for an axis derived from others
    #: (dp_shard = dp / dp_replicate, ep_shard = dp*cp / ep, the flattened axes).
    size_key: str | None = None
    #: The dense axes a flattened axis spans, outermost first (empty for the others).
    spans: tuple[str, ...] = ()
    #: Whether a parallelism sizes it directly (recorded in a checkpoint's layout, named by
    #: `recipes validate`'s size table); the flattened axes and ep_shard are derived.
    parallel: bool = True


#: Every axis; within a mesh, outermost first (the dense mesh's row-major rank order).
AXES: tuple[Axis, ...] = (
    Axis("pp", "dense", size_key="pp_size"),
    Axis("dp_replicate", "dense", size_key="dp_replicate_size"),
    Axis("dp_shard", "dense"),
    Axis("cp", "dense", size_key="cp_size"),
    Axis("tp", "dense", size_key="tp_size"),
    Axis("dp", "flattened", size_key="dp_size", spans=("dp_replicate", "dp_shard"), parallel=False),
    Axis("dp_shard_cp", "flattened", spans=("dp_shard", "cp"), parallel=False),
    Axis("dp_cp", "flattened", spans=("dp_replicate", "dp_shard", "cp"), parallel=False),
    Axis("ep_shard", "moe", parallel=False),
    Axis("ep", "moe", size_key="ep_size"),
)

#: Axes of the dense device mesh, outermost first (row-major rank order).
DENSE_AXES: tuple[str, ...] = tuple(a.name for a in AXES if a.mesh == "dense")
#: Flattened axes and the dense axes they span.
FLATTENED_AXES: dict[str, tuple[str, ...]] = {a.name: a.spans for a in AXES if a.mesh == "flattened"}
#: Axes of the MoE mesh (one such mesh per tp coordinate): pp, then its own axes.
MOE_AXES: tuple[str, ...] = ("pp", *(a.name for a in AXES if a.mesh == "moe"))
#: The axes a parallelism sizes directly, in mesh order (dense, then MoE).
PARALLEL_AXES: tuple[str, ...] = tuple(a.name for a in AXES if a.parallel)


def axis(name: str) -> Axis:
    """The table row of `name` (ValueError naming the known axes)."""
    for row in AXES:
        if row.name == name:
            return row
    raise ValueError(f"unknown mesh axis {name!r}; known: {', '.join(a.name for a in AXES)}")
