"""Resume follows this run's LR schedule from the saved step, and a run stopped early (another
`max_steps`) then resumed equals the uninterrupted run when the schedule does not depend on
`max_steps`: the CPU twin of the megatron_fsdp GPU resume test (same pattern, FSDP2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from automodel.recipes.config.sections import LRSchedulerSection
from automodel.recipes.lr_schedule import build_lr_scheduler, lr_multiplier, restore_lr_scheduler
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import RTOL, preload, tiny_config, train_on_rank  # noqa: E402

STEPS = 6


def _scheduler(total_steps: int, lr: float = 0.003) -> torch.optim.lr_scheduler.LRScheduler:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=lr)
    return build_lr_scheduler(
        opt, section=LRSchedulerSection(warmup_steps=1, min_lr=0.0003), base_lr=lr, total_steps=total_steps
    )


def _expected(step: int, total_steps: int, lr: float = 0.003) -> float:
    return lr * lr_multiplier(
        step, warmup_steps=1, decay_steps=total_steps - 1, decay_style="cosine", min_ratio=0.0003 / lr
    )


@pytest.mark.parametrize(("saved_total", "saved_lr"), [(STEPS, 0.003), (3, 0.003), (3, 0.01)])
def test_restore_takes_the_step_from_the_checkpoint_and_the_schedule_from_this_run(saved_total, saved_lr):
    saved = _scheduler(saved_total, lr=saved_lr)
    for _ in range(3):
        saved.optimizer.step()
        saved.step()
    resumed = _scheduler(STEPS)
    restore_lr_scheduler(resumed, saved.state_dict())
    want = _expected(3, STEPS)
    assert resumed.last_epoch == 3
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-12)
    assert resumed.get_last_lr() == [pytest.approx(want, rel=1e-12)]
    resumed.optimizer.step()
    resumed.step()
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(_expected(4, STEPS), rel=1e-12)
    if saved_total == STEPS and saved_lr == 0.003:  # same schedule: bit-identical to running on
        straight = _scheduler(STEPS)
        for _ in range(4):
            straight.optimizer.step()
            straight.step()
        assert straight.optimizer.param_groups[0]["lr"] == resumed.optimizer.param_groups[0]["lr"]


def _config(out: Path, **step_scheduler: Any) -> dict[str, Any]:
    cfg = tiny_config(
        str(out),
        step_scheduler={"max_steps": STEPS, "val_every_steps": None, "ckpt_every_steps": 3, **step_scheduler},
        # decay over a fixed number of steps: a run stopped at step 3 follows the 6-step run's schedule
        lr_scheduler={"decay_steps": STEPS - 1},
        checkpoint={"enabled": True, "save_consolidated": False},
        validation_dataset=None,
    )
    cfg["model"]["dtype"] = "float32"
    return cfg


def test_stopped_then_resumed_equals_the_uninterrupted_run(tmp_path):
    preload()
    full = run_on_ranks(train_on_rank, world_size=2, args=(_config(tmp_path / "full"),), timeout_s=300)[0]
    first = run_on_ranks(train_on_rank, world_size=2, args=(_config(tmp_path / "run", max_steps=3),))[0]
    resumed = run_on_ranks(train_on_rank, world_size=2, args=(_config(tmp_path / "run"),), timeout_s=300)[0]
    assert len(first) == 3 and len(resumed) == 3
    for step, (got, ref) in enumerate(zip(first + resumed, full, strict=True), start=1):
        assert abs(got - ref) <= RTOL * abs(ref), f"step {step}: {got} vs uninterrupted {ref}"
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    full_records = [
        json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["lr"] for r in records] == [r["lr"] for r in full_records]
