"""Parallelism sizes and their resolution against a world size.

`ParallelismSizes` is what a user writes (dp may be left to be derived); `ResolvedLayout` is the
fully-determined layout every other piece reads. All arithmetic about ranks lives here, so a
layout can be checked for 16k ranks without creating a single process group.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from automodel.mesh.axes import AXES, DENSE_AXES, FLATTENED_AXES, MOE_AXES

__all__ = ["DENSE_AXES", "FLATTENED_AXES", "MOE_AXES", "ParallelismSizes", "ResolvedLayout"]


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class ParallelismSizes:
    """The six parallelism sizes as a user writes them; `dp_size=None` means derived."""

    dp_size: int | None = None
    dp_replicate_size: int | None = None
    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in ("dp_size", "dp_replicate_size"):
                continue
            _check_positive_int(f.name, value)

    def resolve(self, world_size: int) -> ResolvedLayout:
        """Derive dp and check every divisibility rule for `world_size` ranks."""
        _check_positive_int("world_size", world_size)
        tp, pp, cp, ep = self.tp_size, self.pp_size, self.cp_size, self.ep_size
        model_parallel = tp * pp * cp
        if world_size % model_parallel != 0:
            raise ValueError(
                f"world_size {world_size} is not divisible by tp_size*pp_size*cp_size = {model_parallel} "
                f"(tp_size={tp}, pp_size={pp}, cp_size={cp})"
            )
        dp = world_size // model_parallel
        if self.dp_size is not None and self.dp_size != dp:
            raise ValueError(
                f"dp_size={self.dp_size} does not fit world_size {world_size}: dp_size*tp_size*pp_size*cp_size "
                f"= {self.dp_size * model_parallel}, expected dp_size={dp} (or leave dp_size unset)"
            )
        dp_replicate = 1 if self.dp_replicate_size is None else self.dp_replicate_size
        if dp % dp_replicate != 0:
            raise ValueError(f"dp_replicate_size={dp_replicate} must divide dp_size={dp}")
        if dp_replicate > 1 and dp_replicate == dp:
            raise ValueError(
                f"dp_replicate_size={dp_replicate} equals dp_size={dp}: pure replication without sharding "
                "is what strategy: ddp is for; use dp_replicate_size < dp_size"
            )
        if (dp * cp) % ep != 0:
            raise ValueError(
                f"dp_size*cp_size = {dp * cp} (dp_size={dp}, cp_size={cp}) is not divisible by ep_size={ep}"
            )
        return ResolvedLayout(
            world_size=world_size,
            pp=pp,
            dp_replicate=dp_replicate,
            dp_shard=dp // dp_replicate,
            cp=cp,
            tp=tp,
            ep=ep,
        )


@dataclass(frozen=True)
class ResolvedLayout:
    """A fully determined layout: every axis size, and the rank arithmetic over them."""

    world_size: int
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_cp(self) -> int:
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

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
        """Parameters are sharded (over dp_shard and/or cp)."""
        return self.dp_shard_cp > 1

    # ---- shapes --------------------------------------------------------------------------
    def axis_size(self, name: str) -> int:
        """Size of a dense, flattened or MoE axis by name."""
        if any(a.name == name for a in AXES):
            return getattr(self, name)
        raise ValueError(f"unknown mesh axis {name!r}; known: {', '.join(self.axis_names())}")

    @staticmethod
    def axis_names() -> tuple[str, ...]:
        return DENSE_AXES + tuple(FLATTENED_AXES) + MOE_AXES[1:]

    @property
    def dense_shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in DENSE_AXES)

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
        for axis, size in zip(reversed(DENSE_AXES), reversed(self.dense_shape)):
            coords[axis] = rest % size
            rest //= size
        dp_cp_index = (coords["dp_replicate"] * self.dp_shard + coords["dp_shard"]) * self.cp + coords["cp"]
        coords["ep_shard"], coords["ep"] = divmod(dp_cp_index, self.ep)
        return coords

    def group_ranks(self, rank: int, axis: str) -> list[int]:
        """The ranks that share a process group with `rank` along `axis` (in group order)."""
        coords = self.coordinates(rank)
        if axis in DENSE_AXES:
            spanned: tuple[str, ...] = (axis,)
        elif axis in FLATTENED_AXES:
            spanned = FLATTENED_AXES[axis]
        elif axis in MOE_AXES:
            return self._moe_group_ranks(coords, axis)
        else:
            raise ValueError(f"unknown mesh axis {axis!r}; known: {', '.join(self.axis_names())}")
        strides = self._dense_strides()
        members = [rank - sum(coords[a] * strides[a] for a in spanned)]
        for a in spanned:  # outermost first: the last spanned axis varies fastest (row-major)
            members = [m + i * strides[a] for m in members for i in range(getattr(self, a))]
        return members

    def _dense_strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each dense axis (row-major)."""
        strides: dict[str, int] = {}
        step = 1
        for axis, size in zip(reversed(DENSE_AXES), reversed(self.dense_shape)):
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
        parts = [f"{a}={getattr(self, a)}" for a in DENSE_AXES]
        if self.ep_enabled:
            parts += [f"ep={self.ep}", f"ep_shard={self.ep_shard}"]
        return f"world_size={self.world_size}: " + " ".join(parts)
