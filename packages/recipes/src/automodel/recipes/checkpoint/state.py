"""`TrainingState` and its conversion to and from one resharding-friendly DCP state dict.

Model and optimizer state are keyed by parameter FQN (optimizer state flattened), so a
checkpoint written by one layout (FSDP2 dp=4, TP=2, PP stages on different ranks) loads into
any other: DCP matches keys and re-slices DTensor shards. Per-rank, non-tensor state (step,
LR schedulers, dataloader position, RNG) goes under one opaque key per rank.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from automodel.recipes.checkpoint.part_state import part_model_state_dict, state_module

MODEL_KEY = "model"
OPTIM_KEY = "optim"
EXTRA_PREFIX = "extra_rank"


@dataclass
class TrainingState:
    """Everything a resumed run needs; the loop owns it, the `Checkpointer` reads and fills it.

    `model_parts` are this rank's modules (one per PP stage it holds, else one); `optimizers`
    pair with them one-to-one (or are empty). `dataloader` needs ``state_dict()`` and
    ``load_state_dict()``; its state should describe the global position so it survives a
    change of layout. `step` is the number of optimizer steps done.
    """

    model_parts: list[nn.Module]
    optimizers: list[Any]
    lr_schedulers: list[Any]
    dataloader: Any
    step: int
    hf_config: Any = None
    tokenizer: Any = None

    def __post_init__(self) -> None:
        if not self.model_parts:
            raise ValueError("TrainingState.model_parts must hold at least one module, got []")
        if self.optimizers and len(self.optimizers) != len(self.model_parts):
            raise ValueError(
                f"TrainingState.optimizers must pair with model_parts one-to-one: "
                f"{len(self.optimizers)} optimizers for {len(self.model_parts)} model parts"
            )
        if not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"TrainingState.step must be an integer >= 0, got {self.step!r}")


_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state_dict(model_parts: list[nn.Module]) -> dict[str, Any]:
    """FQN -> (sharded) tensor over all parts of this rank."""
    merged: dict[str, Any] = {}
    for part in model_parts:
        merged.update(part_model_state_dict(part))
    return merged


def _optim_state_dict(state: TrainingState) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part, opt in zip(state.model_parts, state.optimizers):
        merged.update(get_optimizer_state_dict(state_module(part), opt, options=_OPTIM_OPTIONS))
    return merged


def _rng_state() -> dict[str, Any]:
    rng: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        rng["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    return rng


def _set_rng_state(rng: dict[str, Any]) -> None:
    random.setstate(rng["python"])
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if "numpy" in rng:
        import numpy as np

        np.random.set_state(rng["numpy"])


def _extra_state(state: TrainingState) -> bytes:
    extra = {
        "step": state.step,
        "lr_schedulers": [s.state_dict() for s in state.lr_schedulers],
        "dataloader": state.dataloader.state_dict() if state.dataloader is not None else None,
        "rng": _rng_state(),
    }
    # One opaque leaf: DCP would otherwise flatten nested dicts into keys that must match on load.
    return pickle.dumps(extra)


def build_save_state(state: TrainingState) -> dict[str, Any]:
    """The DCP state dict to save for this rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sd: dict[str, Any] = {MODEL_KEY: model_state_dict(state.model_parts)}
    if state.optimizers:
        sd[OPTIM_KEY] = _optim_state_dict(state)
    sd[f"{EXTRA_PREFIX}{rank}"] = _extra_state(state)
    return sd


def build_load_state(state: TrainingState, *, extra_key: str, with_optim: bool) -> dict[str, Any]:
    """Placeholders shaped like this rank's state, for ``dcp.load`` to fill in place."""
    sd: dict[str, Any] = {MODEL_KEY: model_state_dict(state.model_parts)}
    if with_optim and state.optimizers:
        sd[OPTIM_KEY] = _optim_state_dict(state)
    sd[extra_key] = b""
    return sd


def apply_loaded_state(
    state: TrainingState, loaded: dict[str, Any], *, extra_key: str, restore_rng: bool
) -> None:
    """Push a filled state dict into the modules, optimizers, schedulers, dataloader and RNG."""
    for part in state.model_parts:
        keys = part_model_state_dict(part).keys()
        set_model_state_dict(state_module(part), {k: loaded[MODEL_KEY][k] for k in keys})
    if OPTIM_KEY in loaded:
        for part, opt in zip(state.model_parts, state.optimizers):
            module = state_module(part)
            keys = get_optimizer_state_dict(module, opt, options=_OPTIM_OPTIONS).keys()
            set_optimizer_state_dict(
                module, opt, {k: loaded[OPTIM_KEY][k] for k in keys}, options=_OPTIM_OPTIONS
            )
    extra = pickle.loads(loaded[extra_key])
    saved_scheds = extra["lr_schedulers"]
    if state.lr_schedulers and not saved_scheds:
        raise ValueError("the checkpoint holds no LR scheduler state but this run has LR schedulers")
    # Every stage's scheduler follows the same schedule: the first saved one stands for all,
    # so a checkpoint from a different PP layout (other scheduler count) still restores.
    for sched in state.lr_schedulers:
        sched.load_state_dict(saved_scheds[0])
    if state.dataloader is not None and extra["dataloader"] is not None:
        state.dataloader.load_state_dict(extra["dataloader"])
    if restore_rng:
        _set_rng_state(extra["rng"])
    state.step = int(extra["step"])
