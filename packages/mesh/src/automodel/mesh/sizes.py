"""Parallelism sizes and their resolution against a world size.

`ParallelismSizes` is what a user writes (dp may be left to be derived); `ResolvedLayout` is the
fully-determined layout every other piece reads. All arithmetic about ranks lives here, so a
layout can be checked for 16k ranks without creating a single process group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from automodel.mesh.axes import axes, dense_axes, flattened_axes, moe_axes

__all__ = ["ParallelismSizes", "ResolvedLayout"]


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


class ParallelismSizes:
    """The sizes as a user writes them, one per size key of the axis table (`axes()`):
    ``ParallelismSizes(tp_size=2)``, read back as ``sizes.tp_size``. An optional key (dp_size,
    dp_replicate_size) may be None (derived); the others default to 1. Immutable and hashable."""

    __slots__ = ("_sizes",)
    _sizes: dict[str, int | None]

    def __init__(self, **sizes: int | None) -> None:
        rows = {a.size_key: a for a in axes() if a.size_key is not None}
        unknown = sorted(set(sizes) - set(rows))
        if unknown:
            raise TypeError(f"ParallelismSizes got unknown size keys {unknown}; known: {', '.join(rows)}")
        values: dict[str, int | None] = {}
        for key, row in rows.items():
            value = sizes.get(key, None if row.optional else 1)
            if not (value is None and row.optional):
                _check_positive_int(key, value)
            values[key] = value
        object.__setattr__(self, "_sizes", values)

    def __getattr__(self, name: str) -> int | None:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._sizes[name]
        except KeyError:
            raise AttributeError(f"ParallelismSizes has no size key {name!r}") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ParallelismSizes is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ParallelismSizes) and self._sizes == other._sizes

    def __hash__(self) -> int:
        return hash(tuple(self._sizes.items()))

    def __repr__(self) -> str:
        return f"ParallelismSizes({', '.join(f'{k}={v!r}' for k, v in self._sizes.items())})"

    def __reduce__(self) -> tuple[object, ...]:
        return (_sizes_from, (self._sizes,))

    def as_dict(self) -> dict[str, int | None]:
        """Every size key and its value (None: derived)."""
        return dict(self._sizes)

    def size(self, key: str) -> int:
        """The size of a key that is never None (a model-parallel or MoE axis's)."""
        value = self._sizes[key]
        assert value is not None, key
        return value

    def resolve(self, world_size: int) -> ResolvedLayout:
        """Derive dp and check every divisibility rule for `world_size` ranks."""
        _check_positive_int("world_size", world_size)
        split = {a.size_key: self.size(a.size_key) for a in axes() if a.model_parallel and a.size_key}
        model_parallel = math.prod(split.values())
        if world_size % model_parallel != 0:
            keys = "*".join(split)
            each = ", ".join(f"{k}={v}" for k, v in split.items())
            raise ValueError(
                f"world_size {world_size} is not divisible by {keys} = {model_parallel} ({each})"
            )
        dp = world_size // model_parallel
        dp_size = self._sizes["dp_size"]
        if dp_size is not None and dp_size != dp:
            raise ValueError(
                f"dp_size={dp_size} does not fit world_size {world_size}: dp_size*{'*'.join(split)} "
                f"= {dp_size * model_parallel}, expected dp_size={dp} (or leave dp_size unset)"
            )
        replicate = self._sizes["dp_replicate_size"]
        dp_replicate = 1 if replicate is None else replicate
        if dp % dp_replicate != 0:
            raise ValueError(f"dp_replicate_size={dp_replicate} must divide dp_size={dp}")
        if dp_replicate > 1 and dp_replicate == dp:
            raise ValueError(
                f"dp_replicate_size={dp_replicate} equals dp_size={dp}: pure replication without sharding "
                "is what strategy: ddp is for; use dp_replicate_size < dp_size"
            )
        # the experts split the ranks of dp_cp: dp and every axis holding parameter replicas (cp)
        replicas = {a.size_key: self.size(a.size_key) for a in axes() if a.holds_replicas and a.size_key}
        dp_cp, ep = dp * math.prod(replicas.values()), self.size("ep_size")
        if dp_cp % ep != 0:
            each = ", ".join(f"{k}={v}" for k, v in {"dp_size": dp, **replicas}.items())
            raise ValueError(
                f"{'*'.join(['dp_size', *replicas])} = {dp_cp} ({each}) is not divisible by ep_size={ep}"
            )
        sized = {
            a.name: self.size(a.size_key)
            for a in axes()
            if a.parallel and a.size_key is not None and not a.optional
        }
        return ResolvedLayout(
            world_size=world_size, dp_replicate=dp_replicate, dp_shard=dp // dp_replicate, **sized
        )


def _sizes_from(sizes: Mapping[str, int | None]) -> ParallelismSizes:
    return ParallelismSizes(**sizes)


class ResolvedLayout:
    """A fully determined layout: every axis size (the axis table's parallel axes, read as
    ``layout.tp`` or ``layout.axis_size("tp")``), and the rank arithmetic over them. Immutable."""

    __slots__ = ("_sizes", "world_size")
    world_size: int
    _sizes: dict[str, int]

    def __init__(self, *, world_size: int, **sizes: int) -> None:
        names = [a.name for a in axes() if a.parallel]
        unknown = sorted(set(sizes) - set(names))
        if unknown:
            raise TypeError(f"ResolvedLayout got unknown axes {unknown}; known: {', '.join(names)}")
        values = {name: sizes.get(name, 1) for name in names}
        for name, value in (("world_size", world_size), *values.items()):
            _check_positive_int(name, value)
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "_sizes", values)

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._sizes[name]
        except KeyError:
            raise AttributeError(f"ResolvedLayout has no axis {name!r}") from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ResolvedLayout is immutable")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ResolvedLayout)
            and self.world_size == other.world_size
            and self._sizes == other._sizes
        )

    def __hash__(self) -> int:
        return hash((self.world_size, *self._sizes.items()))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{k}={v}" for k, v in self._sizes.items())
        return f"ResolvedLayout(world_size={self.world_size}, {sizes})"

    def __reduce__(self) -> tuple[object, ...]:
        return (_layout_from, (self.world_size, self._sizes))

    def sizes(self) -> dict[str, int]:
        """Every parallel axis's size, in table order."""
        return dict(self._sizes)

    def enabled(self, name: str) -> bool:
        """Whether axis `name` (any of `axis_names`) has more than one rank."""
        return self.axis_size(name) > 1

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def _span_size(self, name: str) -> int:
        """Ranks of flattened axis `name`: the product of the dense axes it spans."""
        return math.prod(self.axis_size(a) for a in flattened_axes()[name])

    @property
    def dp_shard_cp(self) -> int:
        """FSDP's shard group: dp_shard and every axis holding parameter replicas (cp, ...)."""
        return self._span_size("dp_shard_cp")

    @property
    def dp_cp(self) -> int:
        return self._span_size("dp_cp")

    @property
    def ep_shard(self) -> int:
        return self.dp_cp // self.ep

    # ---- enabled flags -------------------------------------------------------------------
    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (over dp_shard and/or an axis holding replicas, cp)."""
        return self.dp_shard_cp > 1

    # ---- shapes --------------------------------------------------------------------------
    def axis_size(self, name: str) -> int:
        """Size of a dense, flattened or MoE axis by name."""
        if name in self._sizes:
            return self._sizes[name]
        if any(a.name == name for a in axes()):
            value = getattr(self, name)  # a derived size: a property below
            assert isinstance(value, int)
            return value
        raise ValueError(f"unknown mesh axis {name!r}; known: {', '.join(self.axis_names())}")

    @staticmethod
    def axis_names() -> tuple[str, ...]:
        return dense_axes() + tuple(flattened_axes()) + moe_axes()[1:]

    @property
    def dense_shape(self) -> tuple[int, ...]:
        return tuple(self.axis_size(a) for a in dense_axes())

    @property
    def moe_shape(self) -> tuple[int, int, int, int]:
        """(pp, ep_shard, ep, tp): the MoE mesh per tp slice, stacked along a trailing tp dim."""
        return (self.pp, self.ep_shard, self.ep, self.tp)

    # ---- rank arithmetic -----------------------------------------------------------------
    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's coordinate along every dense and MoE axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")
        coords: dict[str, int] = {}
        rest = rank
        for axis, size in zip(reversed(dense_axes()), reversed(self.dense_shape)):
            coords[axis] = rest % size
            rest //= size
        dp_cp_index = 0  # row-major over the dense axes dp_cp spans
        for axis in flattened_axes()["dp_cp"]:
            dp_cp_index = dp_cp_index * self.axis_size(axis) + coords[axis]
        coords["ep_shard"], coords["ep"] = divmod(dp_cp_index, self.ep)
        return coords

    def group_ranks(self, rank: int, axis: str) -> list[int]:
        """The ranks that share a process group with `rank` along `axis` (in group order)."""
        coords = self.coordinates(rank)
        if axis in dense_axes():
            spanned: tuple[str, ...] = (axis,)
        elif axis in flattened_axes():
            spanned = flattened_axes()[axis]
        elif axis in moe_axes():
            return self._moe_group_ranks(coords, axis)
        else:
            raise ValueError(f"unknown mesh axis {axis!r}; known: {', '.join(self.axis_names())}")
        strides = self._dense_strides()
        members = [rank - sum(coords[a] * strides[a] for a in spanned)]
        for a in spanned:  # outermost first: the last spanned axis varies fastest (row-major)
            members = [m + i * strides[a] for m in members for i in range(self.axis_size(a))]
        return members

    def _dense_strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each dense axis (row-major)."""
        strides: dict[str, int] = {}
        step = 1
        for axis, size in zip(reversed(dense_axes()), reversed(self.dense_shape)):
            strides[axis] = step
            step *= size
        return strides

    def _moe_group_ranks(self, coords: dict[str, int], axis: str) -> list[int]:
        def rank_at(ep_shard: int, ep: int) -> int:
            dp_cp_index = ep_shard * self.ep + ep
            return (coords["pp"] * self.dp_cp + dp_cp_index) * self.tp + coords["tp"]

        if axis == "ep":
            return [rank_at(coords["ep_shard"], e) for e in range(self.ep)]
        return [rank_at(s, coords["ep"]) for s in range(self.ep_shard)]

    def describe(self) -> str:
        """One line naming every axis size, for logs and error messages."""
        parts = [f"{a}={self.axis_size(a)}" for a in dense_axes()]
        if self.ep_enabled:
            parts += [f"ep={self.ep}", f"ep_shard={self.ep_shard}"]
        return f"world_size={self.world_size}: " + " ".join(parts)


def _layout_from(world_size: int, sizes: Mapping[str, int]) -> ResolvedLayout:
    return ResolvedLayout(world_size=world_size, **sizes)
