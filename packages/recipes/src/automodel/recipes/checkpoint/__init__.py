"""Checkpoints: sharded DCP training state, consolidated HF export, resume, pre-emption, HF weight loading."""

from automodel.recipes.checkpoint.checkpointer import Checkpointer
from automodel.recipes.checkpoint.consolidated import save_consolidated
from automodel.recipes.checkpoint.paths import CheckpointError
from automodel.recipes.checkpoint.pretrained import load_pretrained_weights
from automodel.recipes.checkpoint.state import TrainingState
from automodel.recipes.config.checkpoint import MODEL_SAVE_FORMATS, CheckpointConfig

__all__ = [
    "MODEL_SAVE_FORMATS",
    "CheckpointConfig",
    "CheckpointError",
    "Checkpointer",
    "TrainingState",
    "load_pretrained_weights",
    "save_consolidated",
]
