"""Schedule registry: every schedule torch registers, by its torch name or a short alias.

The set is read from `torch.distributed.pipelining.schedules` at import time, so a newer torch
that adds a schedule makes it available without a change here.
"""

from __future__ import annotations

import csv
import inspect
from dataclasses import dataclass
from pathlib import Path

import torch.distributed.pipelining.schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from automodel.pipeline import torch_internals

#: Schedules that place two stages per rank in a V (rank r holds stages r and 2p-1-r).
V_SHAPE_SCHEDULES: frozenset[str] = frozenset({"ZBVZeroBubble", "DualPipeV"})

#: Short names used in YAML configs -> torch's registered name.
SCHEDULE_ALIASES: dict[str, str] = {
    "1f1b": "1F1B",
    "gpipe": "GPipe",
    "interleaved1f1b": "Interleaved1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "dfs": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "loopedbfs": "LoopedBFS",
    "interleaved_zb": "InterleavedZeroBubble",
    "zero_bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
    "v_schedule": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
    "dualpipe_v": "DualPipeV",
}


def _registered_schedules() -> dict[str, type]:
    """Concrete public ``Schedule*`` classes of the installed torch, keyed by name without prefix."""
    found: dict[str, type] = {}
    for attr, obj in vars(torch_schedules).items():
        if not (attr.startswith("Schedule") and inspect.isclass(obj)):
            continue
        if issubclass(obj, PipelineScheduleSingle | PipelineScheduleMulti):
            found[attr.removeprefix("Schedule")] = obj
    return found


_REGISTERED: dict[str, type] = _registered_schedules()


def known_schedule_names() -> list[str]:
    """Every accepted `pp_schedule` spelling: torch's names and the aliases that resolve here."""
    aliases = [a for a, target in SCHEDULE_ALIASES.items() if target in _REGISTERED]
    return sorted(_REGISTERED) + sorted(aliases)


@dataclass(frozen=True)
class ScheduleSpec:
    """A resolved schedule: its torch class and how stages are laid out for it."""

    name: str
    cls: type
    multi_stage: bool
    v_shape: bool


def resolve_schedule(name: str) -> ScheduleSpec:
    """Map a `pp_schedule` value (case-insensitive) to its torch schedule class."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"pp_schedule must be a non-empty string, got {name!r}")
    key = name.strip()
    canonical = SCHEDULE_ALIASES.get(key.lower())
    if canonical is None:
        by_lower = {n.lower(): n for n in _REGISTERED}
        canonical = by_lower.get(key.lower()) or by_lower.get(key.lower().removeprefix("schedule"))
    if canonical is None or canonical not in _REGISTERED:
        raise ValueError(
            f"pp_schedule={name!r} is not a known schedule; known: {', '.join(known_schedule_names())}"
        )
    cls = _REGISTERED[canonical]
    return ScheduleSpec(
        name=canonical,
        cls=cls,
        multi_stage=issubclass(cls, PipelineScheduleMulti),
        v_shape=canonical in V_SHAPE_SCHEDULES,
    )


#: torch's micro-batch count rules, by schedule (checked in its constructors; mirrored here so the
#: error names the config keys). n >= stages: the warm-up fills every stage before the first backward.
_AT_LEAST_ONE_PER_STAGE: frozenset[str] = frozenset({"1F1B", "DualPipeV"})
#: n % max(1, n // pp_size) == 0: the micro-batches are run in rounds of equal size.
_EQUAL_ROUNDS: frozenset[str] = frozenset({"Interleaved1F1B", "InterleavedZeroBubble"})


def check_microbatch_count(
    *, spec: ScheduleSpec, pp_batch_size: int, pp_microbatch_size: int, num_stages: int, pp_size: int
) -> None:
    """Refuse a micro-batch count the schedule cannot run, before torch does, naming what to set."""
    m, n = pp_microbatch_size, pp_batch_size // pp_microbatch_size
    given = (
        f"pp_batch_size={pp_batch_size} / pp_microbatch_size={m} gives {n} micro-batch"
        f"{'es' if n != 1 else ''}, but {spec.name} with {num_stages} pipeline stages (pp_size={pp_size})"
    )
    if spec.name in _AT_LEAST_ONE_PER_STAGE and n < num_stages:
        fix = f"set pp_batch_size to at least {num_stages * m} (a multiple of pp_microbatch_size)"
        if pp_batch_size >= num_stages:
            fix += f" or pp_microbatch_size to at most {pp_batch_size // num_stages}"
        raise ValueError(
            f"{given} needs at least one micro-batch per stage ({num_stages}): {fix}, or use gpipe"
        )
    rounds = max(1, n // pp_size)
    if spec.name in _EQUAL_ROUNDS and n % rounds != 0:
        step = m * pp_size
        lower = n // pp_size * step
        raise ValueError(
            f"{given} runs micro-batches in rounds of equal size and needs a count that is a multiple of "
            f"{rounds} (= {n} // pp_size); any multiple of pp_size works: set pp_batch_size to a multiple "
            f"of pp_microbatch_size * pp_size = {step} (e.g. {lower} or {lower + step})"
        )


def check_schedule_csv(path: str | Path) -> None:
    """`path` is a file on this machine: checked when the pipeline is built (`read_csv_stage_layout`)
    and by the recipes before launch, not when `PipelineConfig` is constructed (a config reads no disk)."""
    if not Path(path).is_file():
        raise ValueError(f"pp_schedule_csv={str(path)!r} does not exist or is not a file")


def read_csv_stage_layout(path: str | Path, *, pp_size: int) -> dict[int, list[int]]:
    """Stage ids of every rank as a compute-only schedule CSV lays them out (one row per rank).

    Rows are lists of actions such as ``0F0``, ``1B0``, ``2W1`` (stage, type, micro-batch); empty
    cells are idle steps. The layout decides which stages each rank builds.
    """
    check_schedule_csv(path)
    path = Path(path)
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) != pp_size:
        raise ValueError(
            f"pp_schedule_csv={str(path)!r} has {len(rows)} rows, expected one per pp rank ({pp_size})"
        )
    layout: dict[int, list[int]] = {}
    for rank, row in enumerate(rows):
        stages: set[int] = set()
        for cell in row:
            try:
                action = torch_internals.parse_schedule_action(cell)
            except (RuntimeError, ValueError) as e:
                raise ValueError(
                    f"pp_schedule_csv={str(path)!r}: bad action {cell!r} in row {rank}: {e}"
                ) from e
            if action is not None and action.stage_index is not None and action.stage_index >= 0:
                stages.add(action.stage_index)
        if not stages:
            raise ValueError(f"pp_schedule_csv={str(path)!r}: row {rank} names no stage")
        layout[rank] = sorted(stages)
    all_stages = sorted(s for stages in layout.values() for s in stages)
    if all_stages != list(range(len(all_stages))):
        raise ValueError(
            f"pp_schedule_csv={str(path)!r}: every stage 0..N-1 must appear on exactly one rank, got {layout}"
        )
    return layout
