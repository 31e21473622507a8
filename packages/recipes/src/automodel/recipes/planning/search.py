"""`recipes plan`: enumerate the layouts of a model on N GPUs, keep those whose estimated peak
fits, rank them by estimated throughput (`planning.admit` then keeps those `recipes train` accepts).

The layouts are the registered parallelisms' sizes (`Parallelism.search_sizes`, nested in their
`search_order`) crossed with their options (`search_options`), activation checkpointing and the
local batch size."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from automodel.mesh import dense_axes
from automodel.recipes.errors import ConfigError
from automodel.recipes.parallelisms import SearchPoint, mesh_roles, searched
from automodel.recipes.planning.memory import MemoryEstimate, StepSetup, estimate_step_memory
from automodel.recipes.planning.roofline import Hardware, StepTime, estimate_step_time
from automodel.recipes.planning.shape import ModelShape


@dataclass(frozen=True)
class Candidate:
    setup: StepSetup
    memory: MemoryEstimate
    time: StepTime

    @property
    def tokens_per_s_per_gpu(self) -> float:
        s = self.setup
        world = math.prod(getattr(s, axis) for axis in dense_axes())  # the dense mesh's ranks
        return self.time.tokens / self.time.seconds / world


def _layouts(shape: ModelShape, *, gpus: int, gpus_per_node: int) -> Iterator[dict[str, int]]:
    """Every size assignment of the searched parallelisms (`Parallelism.search_sizes`), nested in
    their `search_order`, outermost first."""
    order = searched()

    def walk(i: int, sizes: dict[str, int]) -> Iterator[dict[str, int]]:
        if i == len(order):
            yield sizes
            return
        room = gpus // math.prod(sizes.get(axis, 1) for axis in dense_axes())
        point = SearchPoint(shape=shape, gpus=gpus, gpus_per_node=gpus_per_node, sizes=sizes, room=room)
        for assignment in order[i].search_sizes(point):
            yield from walk(i + 1, {**sizes, **assignment})

    yield from walk(0, {})


def enumerate_layouts(
    shape: ModelShape,
    *,
    gpus: int,
    seq_len: int,
    hardware: Hardware,
    global_batch: int | None = None,
    trainable_params: int | None = None,
    expert_load_factor: float = 1.0,
) -> list[Candidate]:
    """Every layout of the search space whose estimated peak fits, with its estimates, best first.

    Whether `recipes train` accepts a layout is not decided here: `planning.admit` runs the
    pre-launch checks on the candidates, best first (the rules have one home, `rules.py`).

    `expert_load_factor`: the busiest EP rank's routed slots over the mean (1: balanced)."""
    if gpus < 1:
        raise ConfigError("--gpus", gpus, "must be >= 1")
    if seq_len < 2:
        raise ConfigError("--seq-len", seq_len, "must be >= 2")
    if global_batch is not None and global_batch < 1:
        raise ConfigError("--global-batch", global_batch, "must be >= 1")
    capacity = hardware.memory_bytes * hardware.memory_headroom
    out: list[Candidate] = []
    for sizes in _layouts(shape, gpus=gpus, gpus_per_node=hardware.gpus_per_node):
        _add_batches(
            out,
            shape,
            hardware,
            capacity,
            sizes=sizes,
            gpus=gpus,
            seq_len=seq_len,
            global_batch=global_batch,
            trainable=trainable_params,
            expert_load_factor=expert_load_factor,
        )
    out.sort(key=lambda c: (-c.tokens_per_s_per_gpu, c.memory.peak_bytes))
    return out


def _add_batches(
    out: list[Candidate],
    shape: ModelShape,
    hw: Hardware,
    capacity: float,
    *,
    sizes: Mapping[str, int],
    **k,
) -> None:
    """The candidates of one size assignment: the searched parallelisms' options
    (`Parallelism.search_options`, in search order), then AC, then the local batch sizes."""
    rows = math.prod(sizes.get(a, 1) for a in mesh_roles().batch_axes)  # ranks splitting the rows
    order = searched()
    per_axis = [p.search_options(size=sizes.get(p.name, 1), shape=shape) for p in order]
    batches = next(
        (lbs for p in order if (lbs := p.search_local_batches(size=sizes.get(p.name, 1))) is not None),
        (1, 2, 4, 8),
    )
    for options in itertools.product(*per_axis):
        overrides = {key: value for option in options for key, value in option.items()}
        for ac in (False, True):
            for lbs in batches:
                gb = k["global_batch"] or lbs * rows
                if gb % (lbs * rows):
                    continue
                base = StepSetup(
                    sizes=tuple(sizes.items()), activation_checkpointing=ac,
                    seq_len=k["seq_len"], local_batch=lbs, grad_accum=gb // (lbs * rows),
                    storage_bytes=4, compute_bytes=2, reduce_bytes=4, trainable_params=k["trainable"],
                    expert_load_factor=k["expert_load_factor"],
                )  # fmt: skip
                base = base.with_fields(overrides)
                mem = estimate_step_memory(shape, base)
                if mem.peak_bytes > capacity:
                    continue
                out.append(Candidate(base, mem, estimate_step_time(shape, base, hw, world=k["gpus"])))


__all__ = ["Candidate", "enumerate_layouts", "replace"]
