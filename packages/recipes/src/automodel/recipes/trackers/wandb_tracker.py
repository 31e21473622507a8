"""Weights & Biases (``wandb:``): one wandb run per training run, continued on resume
(``resume="allow"`` with the id kept in ``<output_dir>/trackers/wandb_run_id``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.config.trackers import WandbSection
from automodel.recipes.trackers import TrackerKind, TrackerStart, register, writable_dir


def _section(cfg: RecipeConfig) -> WandbSection | None:
    return cfg.wandb if cfg.wandb is not None and cfg.wandb.enabled else None


def _directory(section: WandbSection, cfg: RecipeConfig) -> Path:
    return Path(section.directory if section.directory is not None else cfg.output_dir)


def _check(section: WandbSection, cfg: RecipeConfig) -> None:
    key = section.directory_key if section.directory is not None else "output_dir"
    writable_dir(key, str(_directory(section, cfg)), _directory(section, cfg))


class WandbTracker:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, *, checkpoint: str | None, failed: bool) -> None:
        if checkpoint is not None:
            self.run.summary["checkpoint"] = checkpoint
        self.run.finish(exit_code=1 if failed else 0)


def _start(start: TrackerStart) -> tuple[WandbTracker, str]:
    import wandb  # lazy: optional dependency

    section: WandbSection = start.section
    directory = _directory(section, start.cfg)
    directory.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=section.project,
        entity=section.entity,
        name=section.name,
        group=section.group,
        tags=section.tags,
        notes=section.notes,
        mode=section.mode,
        dir=str(directory),
        id=start.run_id,  # None: a new run, its id kept for a resume
        resume="allow",
        config=start.cfg.raw,
        allow_val_change=True,  # a resumed run may extend its config (max_steps)
    )
    return WandbTracker(run), run.id


TRACKER = register(
    TrackerKind(name="wandb", package="wandb", extra="wandb", section=_section, check=_check, start=_start)
)
