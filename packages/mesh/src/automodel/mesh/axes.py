"""The mesh axes, in one table: each axis's name, the YAML size key that sizes it, its mesh and
its place in it, and the dense axes a flattened axis spans.

Every list of axes elsewhere (the dense mesh's dims, the flattened dims, the MoE mesh, the sizes
`ParallelismSizes` and `ResolvedLayout` hold, the axes a layout line or a checkpoint's layout
names) is read off the table (`axes()`), so an axis is added once: a row here, or, from a plugin,
one `register_axis` call.
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
    #: A dense axis that splits the world before data parallelism is derived from what is left
    #: (pp, cp, tp): `ParallelismSizes.resolve` divides the world size by their product.
    model_parallel: bool = False
    #: Its size key may be left unset (None): derived (dp) or 1 unless asked for (dp_replicate).
    optional: bool = False
    #: A dense axis whose ranks hold the same parameters and different tokens of each row (cp, a
    #: plugin's sequence axis): their gradients must be summed over it, so the flattened axes with
    #: `spans_replicas` (FSDP's ``dp_shard_cp``, and ``dp_cp``) span it too.
    holds_replicas: bool = False
    #: A flattened axis that spans, besides `spans`, every `holds_replicas` dense axis.
    spans_replicas: bool = False


_BUILT_IN: tuple[Axis, ...] = (
    Axis("pp", "dense", size_key="pp_size", model_parallel=True),
    Axis("dp_replicate", "dense", size_key="dp_replicate_size", optional=True),
    Axis("dp_shard", "dense"),
    Axis("cp", "dense", size_key="cp_size", model_parallel=True, holds_replicas=True),
    Axis("tp", "dense", size_key="tp_size", model_parallel=True),
    Axis(
        "dp",
        "flattened",
        size_key="dp_size",
        spans=("dp_replicate", "dp_shard"),
        parallel=False,
        optional=True,
    ),
    # the data axes and every axis holding parameter replicas (cp, a registered sequence axis): the
    # names are torchtitan's, for the built-in replica axis
    Axis("dp_shard_cp", "flattened", spans=("dp_shard",), parallel=False, spans_replicas=True),
    Axis("dp_cp", "flattened", spans=("dp_replicate", "dp_shard"), parallel=False, spans_replicas=True),
    Axis("ep_shard", "moe", parallel=False),
    Axis("ep", "moe", size_key="ep_size"),
)

#: The table; within a mesh, outermost first (the dense mesh's row-major rank order).
_AXES: list[Axis] = list(_BUILT_IN)


def axes() -> tuple[Axis, ...]:
    """Every axis, built-in and registered; within a mesh, outermost first."""
    return tuple(_AXES)


def register_axis(row: Axis, *, before: str) -> Axis:
    """Add a model-parallel dense axis (a plugin's own mesh dim) just outside dense axis `before`
    (``before="tp"``: the new axis's ranks are tp groups apart). Only a dense, model-parallel axis
    with a size key can be added: the flattened and MoE axes are arithmetic over the dense ones (an
    axis with `Axis.holds_replicas` joins ``dp_shard_cp`` and ``dp_cp``, as cp does)."""
    if row.mesh != "dense" or not row.model_parallel or row.size_key is None or not row.parallel:
        raise ValueError(
            f"axis {row.name!r}: only a dense, model-parallel axis with a size key can be registered"
        )
    if any(a.name == row.name for a in _AXES):
        raise ValueError(f"mesh axis {row.name!r} is registered twice")
    if any(a.size_key == row.size_key for a in _AXES):
        raise ValueError(f"axis {row.name!r}: size key {row.size_key!r} is taken")
    at = [i for i, a in enumerate(_AXES) if a.name == before and a.mesh == "dense"]
    if not at:
        raise ValueError(f"axis {row.name!r}: before={before!r} is not a dense axis; dense: {dense_axes()}")
    _AXES.insert(at[0], row)
    return row


def unregister_axis(name: str) -> None:
    """Remove a registered axis (tests that register a toy one); a built-in one stays."""
    if any(a.name == name for a in _BUILT_IN):
        raise ValueError(f"mesh axis {name!r} is built in")
    _AXES[:] = [a for a in _AXES if a.name != name]


def dense_axes() -> tuple[str, ...]:
    """Axes of the dense device mesh, outermost first (row-major rank order)."""
    return tuple(a.name for a in _AXES if a.mesh == "dense")


def flattened_axes() -> dict[str, tuple[str, ...]]:
    """Flattened axes and the dense axes they span, in dense order (``dp_shard_cp`` spans dp_shard
    and every axis that holds parameter replicas: cp, and a registered one that says so)."""
    replicas = {a.name for a in _AXES if a.mesh == "dense" and a.holds_replicas}
    return {
        a.name: tuple(d for d in dense_axes() if d in a.spans or (a.spans_replicas and d in replicas))
        for a in _AXES
        if a.mesh == "flattened"
    }


def moe_axes() -> tuple[str, ...]:
    """Axes of the MoE mesh (one such mesh per tp coordinate): pp, then its own axes."""
    return ("pp", *(a.name for a in _AXES if a.mesh == "moe"))


def parallel_axes() -> tuple[str, ...]:
    """The axes a parallelism sizes directly, in mesh order (dense, then MoE)."""
    return tuple(a.name for a in _AXES if a.parallel)


def axis(name: str) -> Axis:
    """The table row of `name` (ValueError naming the known axes)."""
    for row in _AXES:
        if row.name == name:
            return row
    raise ValueError(f"unknown mesh axis {name!r}; known: {', '.join(a.name for a in _AXES)}")
