"""YAML -> composed model -> training loop, checkpoints, and the `recipes` CLI.

Python API: ``load_config`` (YAML or mapping + overrides -> validated `RecipeConfig`) and ``train``
(one rank of a job; returns the per-step losses and gradient norms). They are imported on first
use, so ``import automodel.recipes`` (and the CLI's start-up) stays light.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from automodel.recipes._version import __version__ as __version__

_API = {
    "load_config": "automodel.recipes.api",
    "train": "automodel.recipes.api",
    "ConfigError": "automodel.recipes.errors",
    "RecipeConfig": "automodel.recipes.config.recipe",
    "TrainResult": "automodel.recipes.trainer",
}
__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'automodel.recipes' has no attribute {name!r}")
    return getattr(import_module(_API[name]), name)
