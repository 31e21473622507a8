"""NeMo AutoModel's LR schedule (its OptimizerParamScheduler): linear warm-up from `init_lr` to the
LR, then cosine / linear decay to `min_lr` (or constant), as a stateful LambdaLR; and its restore
on resume (this run's schedule at the saved step). Unset keys take AutoModel's defaults
(`schedule_values`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from automodel.recipes.torch_internals import set_last_lr

if TYPE_CHECKING:
    from automodel.recipes.config.sections import LRSchedulerSection


#: AutoModel's defaults (nemo_automodel LRSchedulerConfig.build)
MAX_DEFAULT_WARMUP = 1000
INIT_RATIO, MIN_RATIO = 0.1, 0.01


def lr_multiplier(
    step: int,
    *,
    warmup_steps: int,
    decay_steps: int,
    decay_style: str,
    min_ratio: float,
    init_ratio: float = INIT_RATIO,
) -> float:
    """Factor on the base lr for the optimizer step with index `step` (0-based): AutoModel's
    ``init + (max - init) * step / warmup`` up to the warm-up's end, then the decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return init_ratio + (1.0 - init_ratio) * step / warmup_steps
    if decay_style == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, decay_steps))
    if decay_style == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def schedule_values(section: LRSchedulerSection, *, base_lr: float, total_steps: int) -> dict[str, Any]:
    """The schedule's numbers with AutoModel's defaults for unset keys: warm-up
    min(1000, total // 10) steps, init_lr 0.1 x LR, min_lr 0.01 x LR, decay over the rest of the run."""
    warmup = section.warmup_steps
    if warmup is None:
        warmup = min(MAX_DEFAULT_WARMUP, total_steps // 10)
    min_lr = section.min_lr if section.min_lr is not None else MIN_RATIO * base_lr
    init_lr = section.init_lr if section.init_lr is not None else INIT_RATIO * base_lr
    return {
        "warmup_steps": warmup,
        "decay_steps": section.decay_steps
        if section.decay_steps is not None
        else max(1, total_steps - warmup),
        "decay_style": section.decay_style,
        "min_ratio": min(1.0, min_lr / base_lr) if base_lr > 0 else 0.0,
        "init_ratio": min(1.0, init_lr / base_lr) if base_lr > 0 else 0.0,
    }


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, section: LRSchedulerSection, base_lr: float, total_steps: int
) -> LambdaLR:
    values = schedule_values(section, base_lr=base_lr, total_steps=total_steps)

    def fn(step: int) -> float:
        return lr_multiplier(step, **values)

    return LambdaLR(optimizer, fn)


def restore_lr_scheduler(scheduler: LRScheduler, saved: dict[str, Any]) -> None:
    """Continue `scheduler` at the saved step count, under this run's schedule and base LR.

    A LambdaLR's state holds the step count and the base LRs of the run that saved it, and the
    optimizer's param groups hold the LR that run set last. Loaded as they are, a resumed run whose
    schedule differs (another `max_steps`, hence other decay steps, or another `optimizer.lr`)
    would take its first step at the old run's LR and keep the old base LR for good. Here the step
    count comes from the checkpoint and everything else from this run: the param groups get this
    run's LR for that step now. Other schedulers are restored as saved.
    """
    if not isinstance(scheduler, LambdaLR):
        scheduler.load_state_dict(saved)
        return
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict(saved)
    scheduler.base_lrs = base_lrs
    values = [
        base * fn(scheduler.last_epoch) for base, fn in zip(base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(scheduler.optimizer.param_groups, values, strict=True):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    set_last_lr(scheduler, values)  # what get_last_lr() reports for the next step
