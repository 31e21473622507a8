"""Linear warm-up then cosine / linear decay to `min_lr` (or constant), as a stateful LambdaLR."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_multiplier(
    step: int, *, warmup_steps: int, decay_steps: int, decay_style: str, min_ratio: float
) -> float:
    """Factor on the base lr for the optimizer step with index `step` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay_style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps))
    if decay_style == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, section: object, base_lr: float, total_steps: int
) -> LambdaLR:
    warmup = section.warmup_steps
    decay_steps = section.decay_steps if section.decay_steps is not None else max(1, total_steps - warmup)
    min_ratio = min(1.0, section.min_lr / base_lr) if base_lr > 0 else 0.0

    def fn(step: int) -> float:
        return lr_multiplier(
            step,
            warmup_steps=warmup,
            decay_steps=decay_steps,
            decay_style=section.decay_style,
            min_ratio=min_ratio,
        )

    return LambdaLR(optimizer, fn)
