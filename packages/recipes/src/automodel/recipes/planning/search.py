"""`recipes plan`: enumerate the layouts of a model on N GPUs, keep those whose estimated peak
fits, rank them by estimated throughput (`planning.admit` then keeps those `recipes train` accepts)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from automodel.mesh import DENSE_AXES
from automodel.recipes.errors import ConfigError
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
        world = math.prod(getattr(s, axis) for axis in DENSE_AXES)  # the dense mesh's ranks
        return self.time.tokens / self.time.seconds / world


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    g = hardware.gpus_per_node
    capacity = hardware.memory_bytes * hardware.memory_headroom
    out: list[Candidate] = []
    for tp in _divisors(min(gpus, g)):
        for pp in _divisors(gpus // tp):
            if pp > 1 and shape.layers < 2 * pp:
                continue
            for cp in (c for c in _divisors(gpus // (tp * pp)) if c <= 8):
                dp = gpus // (tp * pp * cp)
                eps = [1]
                if shape.is_moe:
                    eps = [e for e in _divisors(shape.experts) if e <= dp * cp and (dp * cp) % e == 0]
                for ep in eps:
                    reps = [1] + [r for r in _divisors(dp) if r > 1 and (dp // r) * cp * tp == g]
                    for rep in reps:
                        _add_batches(
                            out,
                            shape,
                            hardware,
                            capacity,
                            gpus=gpus,
                            seq_len=seq_len,
                            global_batch=global_batch,
                            trainable=trainable_params,
                            expert_load_factor=expert_load_factor,
                            tp=tp,
                            pp=pp,
                            cp=cp,
                            ep=ep,
                            dp_shard=dp // rep,
                            dp_replicate=rep,
                        )
    out.sort(key=lambda c: (-c.tokens_per_s_per_gpu, c.memory.peak_bytes))
    return out


def _add_batches(out: list[Candidate], shape: ModelShape, hw: Hardware, capacity: float, **k) -> None:
    tp, pp, cp, ep, dps, rep = k["tp"], k["pp"], k["cp"], k["ep"], k["dp_shard"], k["dp_replicate"]
    dp = dps * rep
    schedules = ["1f1b", "interleaved1f1b"] if pp > 1 else ["1f1b"]
    for schedule in schedules:
        v = 2 if schedule == "interleaved1f1b" else 1
        if pp > 1 and shape.layers < pp * v:
            continue
        # moe.reshard_after_forward (EP only): False (the default) keeps every layer's gathered
        # weights from forward to backward, True frees them and gathers again in backward
        for reshard, ac in itertools.product((False, True) if ep > 1 else (None,), (False, True)):
            for lbs in (1, 2, 4, 8) if pp == 1 else (pp, 2 * pp, 4 * pp):
                gb = k["global_batch"] or lbs * dp
                if gb % (lbs * dp):
                    continue
                base = StepSetup(
                    tp=tp, pp=pp, cp=cp, ep=ep, dp_shard=dps, dp_replicate=rep,
                    sequence_parallel=tp > 1 and not shape.is_moe, activation_checkpointing=ac,
                    seq_len=k["seq_len"], local_batch=lbs, grad_accum=gb // (lbs * dp), pp_microbatch=1,
                    pp_schedule=schedule, stages_per_rank=v, storage_bytes=4, compute_bytes=2, reduce_bytes=4,
                    trainable_params=k["trainable"],
                    reshard_after_forward=reshard,
                    expert_load_factor=k["expert_load_factor"],
                )  # fmt: skip
                mem = estimate_step_memory(shape, base)
                if mem.peak_bytes > capacity:
                    continue
                out.append(Candidate(base, mem, estimate_step_time(shape, base, hw, world=k["gpus"])))


__all__ = ["Candidate", "enumerate_layouts", "replace"]
