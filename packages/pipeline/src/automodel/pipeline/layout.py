"""Stage arithmetic: how many stages, which ones a rank holds, which layers each one gets.

Pure functions of integers (no process group), so a layout can be checked for any pp size.
"""

from __future__ import annotations

import math
from typing import Literal


def num_stages_for(
    *,
    num_layers: int,
    pp_size: int,
    multi_stage: bool,
    layers_per_stage: int | None = None,
    round_to_pp_multiple: Literal["up", "down"] | None = None,
) -> int:
    """Total number of stages: one (single-stage schedules) or two (multi-stage) per rank by
    default, else ``ceil(num_layers / layers_per_stage)`` rounded to a multiple of `pp_size`."""
    if layers_per_stage is None:
        stages = pp_size * (2 if multi_stage else 1)
    else:
        stages = math.ceil(num_layers / layers_per_stage)
        if stages % pp_size != 0:
            if round_to_pp_multiple == "up":
                stages = math.ceil(stages / pp_size) * pp_size
            elif round_to_pp_multiple == "down":
                stages = max(pp_size, stages // pp_size * pp_size)
            else:
                raise ValueError(
                    f"layers_per_stage={layers_per_stage} gives {stages} stages for {num_layers} layers, "
                    f"not a multiple of pp_size={pp_size}; change layers_per_stage or set "
                    "round_virtual_stages_to_pp_multiple='up' or 'down'"
                )
    check_stages_per_rank(num_stages=stages, pp_size=pp_size, multi_stage=multi_stage)
    if stages > num_layers:
        raise ValueError(
            f"{stages} pipeline stages for a model with {num_layers} layers: every stage needs at least "
            "one layer (lower pp_size, raise layers_per_stage, or use a single-stage schedule)"
        )
    return stages


def check_stages_per_rank(*, num_stages: int, pp_size: int, multi_stage: bool) -> int:
    """Stages per rank, after checking the schedule can run that many."""
    if num_stages % pp_size != 0:
        raise ValueError(f"number of stages {num_stages} is not divisible by pp_size={pp_size}")
    per_rank = num_stages // pp_size
    if multi_stage and per_rank < 2:
        raise ValueError(
            f"pp_schedule is a multi-stage schedule but the layout gives {per_rank} stage per rank "
            f"({num_stages} stages on pp_size={pp_size}); it needs >= 2 stages per rank "
            "(lower layers_per_stage, or pick 1f1b/gpipe)"
        )
    if not multi_stage and per_rank != 1:
        raise ValueError(
            f"pp_schedule is a single-stage schedule but the layout gives {per_rank} stages per rank "
            f"({num_stages} stages on pp_size={pp_size}); use a multi-stage schedule such as interleaved1f1b"
        )
    return per_rank


def stage_ids_this_rank(*, pp_rank: int, pp_size: int, num_stages: int, v_shape: bool = False) -> list[int]:
    """Stage ids rank `pp_rank` holds: round-robin ``r, r+p, r+2p, ...``, or for V-shape
    schedules (zbv, dualpipev) ``r`` and ``2p-1-r`` so the first and last stage share rank 0."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} is outside pp_size={pp_size}")
    if num_stages % pp_size != 0:
        raise ValueError(f"number of stages {num_stages} is not divisible by pp_size={pp_size}")
    per_rank = num_stages // pp_size
    if v_shape:
        if per_rank != 2:
            raise ValueError(f"V-shape schedules need exactly 2 stages per rank, got {per_rank}")
        return [pp_rank, num_stages - 1 - pp_rank]
    return [pp_rank + i * pp_size for i in range(per_rank)]


def split_layers_evenly(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges per stage; the remainder goes one each to the first stages."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} non-empty stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for stage in range(num_stages):
        count = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


#: torch releases whose schedule set-up sends a tensor between adjacent stages even when one rank
#: holds both; gloo cannot send from a rank to itself, so such layouts fail there on these releases
_SELF_SEND_AT_SETUP = ("2.11.",)


def check_adjacent_stages_on_one_rank(
    stage_ids_per_rank: dict[int, list[int]], *, backend: str, torch_version: str
) -> None:
    """Refuse, before any stage is built, a layout that torch cannot set up on this backend.

    On torch 2.11 every schedule with several stages per rank first exchanges a tensor between
    neighbouring stages over the process group; when one rank holds stages i and i+1 (the V of
    zbv / dualpipev, or a CSV schedule) that is a send to itself, which gloo rejects ("Pair is not
    connected"). torch >= 2.12 sets local neighbours up without the process group.
    """
    if backend != "gloo" or not torch_version.startswith(_SELF_SEND_AT_SETUP):
        return
    for rank, stages in stage_ids_per_rank.items():
        held = set(stages)
        pair = next((s for s in sorted(held) if s + 1 in held), None)
        if pair is not None:
            raise ValueError(
                f"pp rank {rank} holds the adjacent stages {pair} and {pair + 1} (V-shape schedules such as "
                f"zbv and dualpipev always do): torch {torch_version} sets such stages up with a send from "
                "the rank to itself, which the gloo backend cannot do. Use torch >= 2.12, the nccl backend, "
                "or a schedule that places adjacent stages on different ranks (interleaved1f1b, 1f1b)"
            )
