"""Measured peak memory of real training steps on this rank (the oracle the estimate is tested against).

The measurement reads the c10 CPU/CUDA allocator through torch's profiler (``profile_memory``):
every allocation and free of tensor storage is an event with its size, address and thread.
Profiling starts before the model is built, so the running total counts every tensor the training
thread allocates (parameters, gradients, optimizer state, activations, communication buffers, the
dataset's token tensors) and nothing else (no Python objects, no library code, no allocator
caching, no gloo worker-thread staging copies: see `_main_thread_totals`). It shares no code with `planning.memory`: the estimate never reads these numbers.

A storage whose last reference a collective's worker thread drops is freed outside the profiler's
thread state, so its free is never reported and it would stay "live" here; the measured code must
not hand such copies to the collectives (DDP's flattened initial broadcast did, by chance, until
`automodel.fsdp2.ddp` broadcast in place).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.parallelisms import parallelisms
from automodel.recipes.trainer import Trainer

_STEP_MARK = "automodel.measure.step"


@dataclass(frozen=True)
class StepMemory:
    """Live allocator bytes of one step: at its start and at its highest point."""

    step: int
    start_bytes: int
    peak_bytes: int


def _events(prof: Any) -> list[Any]:
    out: list[Any] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children)
    return out


def _allocation_fields(node: Any, device_type: str) -> Any | None:
    fields = node.extra_fields
    if type(fields).__name__ != "_ExtraFields_Allocation":
        return None
    return fields if fields.device.type == device_type else None


def _main_thread_totals(events: list[Any], device_type: str, main_tid: int) -> list[tuple[int, int]]:
    """(time, live bytes) of the storages the training thread allocated, whichever thread frees them.

    gloo runs each collective on a worker thread that allocates its own staging copies (about 7 MB
    a step for the test models); when they are live relative to the training thread's own peak
    depends on thread scheduling, which made the same step's peak vary by up to ~6% between runs.
    They are a CPU-backend artefact (NCCL stages through buffers outside the caching allocator),
    so they are left out: the training thread's allocations happen in program order, and the
    total is the same on every run."""
    allocs = sorted(
        (node.start_time_ns, node.start_tid, f.ptr, f.alloc_size)
        for node in events
        if (f := _allocation_fields(node, device_type)) is not None
    )
    owned: dict[int, int] = {}
    total = 0
    out = []
    for t, tid, ptr, size in allocs:
        if size > 0 and tid == main_tid:
            # An address handed out again was freed, even where the free left no event.
            total += size - owned.get(ptr, 0)
            owned[ptr] = size
        elif size < 0 and ptr in owned:
            total -= owned.pop(ptr)
        else:
            continue
        out.append((t, total))
    return out


def step_peaks(prof: Any, *, device_type: str = "cpu") -> list[StepMemory]:
    """Per marked step: the training thread's live bytes when it began and the maximum while it ran."""
    events = _events(prof)
    marks = sorted(
        (node.start_time_ns, node.end_time_ns, node.name, node.start_tid)
        for node in events
        if node.name.startswith(_STEP_MARK)
    )
    if not marks:
        return []
    totals = _main_thread_totals(events, device_type, marks[0][3])
    result = []
    for start, end, name, _ in marks:
        before = [total for t, total in totals if t < start]
        inside = [total for t, total in totals if start <= t <= end]
        first = before[-1] if before else 0
        result.append(
            StepMemory(step=int(name.rsplit(".", 1)[-1]), start_bytes=first, peak_bytes=max([first, *inside]))
        )
    return result


@dataclass(frozen=True)
class TrainingMeasurement:
    """Per-step allocator peaks and the run-time facts the parallelisms measured over the last
    step (`Parallelism.step_meter`: with expert parallelism, the busiest ep rank's received rows
    over the mean, the estimate's `expert_load_factor`), as `StepSetup` fields."""

    steps: list[StepMemory]
    fields: dict[str, float]

    @property
    def expert_load_factor(self) -> float | None:
        """The measured expert load factor (None: no parallelism measured one)."""
        return self.fields.get("expert_load_factor")


def measure_training(cfg: RecipeConfig, *, steps: int = 2) -> TrainingMeasurement:
    """Build `cfg`'s model on this rank (inside an initialized process group) and run `steps` real
    training steps of `recipes train` (`Trainer.train_step`) under the allocator profiler."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True) as prof:
        trainer = Trainer(cfg)
        trainer.build()
        trainer.step = 0
        layout = trainer.mesh.layout
        meters = [
            meter
            for p in parallelisms()
            if (meter := p.step_meter(trainer.mesh, size=p.size(cfg.distributed, layout))) is not None
        ]
        for i in range(1, steps + 1):
            batches = trainer.loader.next_step()
            with record_function(f"{_STEP_MARK}.{i}"), ExitStack() as last_step:
                if i == steps:
                    for meter in meters:
                        last_step.enter_context(meter)
                trainer.train_step(batches)
            trainer.step = i
    fields = {key: value for meter in meters for key, value in meter.fields().items()}
    return TrainingMeasurement(
        steps=step_peaks(prof, device_type="cuda" if torch.cuda.is_available() else "cpu"), fields=fields
    )
