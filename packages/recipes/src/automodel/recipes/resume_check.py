"""A run in an existing ``output_dir`` resumes it: refuse to do so silently with another config.

``<output_dir>/config.yaml`` is the config of the run that wrote the directory. When the new config
differs from it in anything but `ALLOWED_CHANGES`, resuming would train the saved weights and
optimizer under settings that are not the ones asked for (an LR silently ignored because the
schedule's state came from the checkpoint, say), so the run stops with every difference listed,
unless ``--resume-with-changes`` says to go on (the old config is kept as ``config.<time>.yaml``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import yaml

from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.errors import ConfigError

CONFIG_FILE = "config.yaml"

#: Dotted key prefixes that may change between a run and its resume: how long to train, how often
#: to validate, save and log, where to save, and the layout (checkpoints reshard across layouts).
ALLOWED_CHANGES = (
    "output_dir",
    "step_scheduler.max_steps",
    "step_scheduler.num_epochs",
    "step_scheduler.ckpt_every_steps",
    "step_scheduler.val_every_steps",
    "step_scheduler.val_batches",
    "logging",
    "checkpoint.restore_from",
    "checkpoint.keep_last_n",
    "checkpoint.save_consolidated",
    "checkpoint.model_save_format",
    "checkpoint.on_corrupt",
    "distributed",
    "dist_env",
)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out or {prefix: {}}
    return {prefix: value}


def _allowed(key: str) -> bool:
    return any(key == a or key.startswith(f"{a}.") for a in ALLOWED_CHANGES)


_ABSENT = object()


def config_differences(saved: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every leaf that differs outside `ALLOWED_CHANGES` (sorted by key)."""
    old_flat, new_flat = _flatten(saved), _flatten(new)
    lines = []
    for key in sorted(set(old_flat) | set(new_flat)):
        if _allowed(key):
            continue
        a, b = old_flat.get(key, _ABSENT), new_flat.get(key, _ABSENT)
        if a != b:
            show = lambda v: "(absent)" if v is _ABSENT else repr(v)  # noqa: E731
            lines.append(f"{key}: {show(a)} -> {show(b)}")
    return lines


def check_config_changes(cfg: RecipeConfig, *, allow_changes: bool) -> list[str]:
    """Compare `cfg.raw` with ``<output_dir>/config.yaml``; return the differences.

    Raises `ConfigError` (key ``output_dir``, exit 2) listing them unless `allow_changes`; with it,
    prints them and keeps the old file as ``config.<time>.yaml`` before the run overwrites it.
    """
    out = Path(cfg.output_dir)
    path = out / CONFIG_FILE
    if not path.is_file():
        return []
    try:
        saved = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError("output_dir", str(out), f"has an unreadable {CONFIG_FILE} ({e})") from None
    diffs = config_differences(saved if isinstance(saved, dict) else {}, cfg.raw)
    if not diffs:
        return []
    if not allow_changes:
        raise ConfigError(
            "output_dir",
            str(out),
            f"holds a run with another config ({path}); resuming it would not train what this config asks. "
            f"Differences: {'; '.join(diffs)}. Pass --resume-with-changes to resume with the new values, "
            "or pick another --output_dir",
        )
    backup = out / f"config.{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    path.replace(backup)
    print(
        f"resuming {out} with a changed config (--resume-with-changes; the old one is now {backup.name}): "
        + "; ".join(diffs),
        file=sys.stderr,
        flush=True,
    )
    return diffs
