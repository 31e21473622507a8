"""Apply the layout to a meta-device model, in one fixed order, and return the model parts.

    PP split -> per stage: TP/SP -> CP hooks -> EP -> activation checkpointing -> compile
    -> FSDP2 / DDP / Megatron-FSDP -> materialize (seeded init or pretrained weights)
    -> (optimizer, built by the loop)

Each step is delegated to its package through the section's strategy (`strategies/`: one module
per strategy); every option was checked when the config was parsed, so nothing here falls back
quietly. Data-parallel gradient reductions SUM
(``gradient_divide_factor=1.0``): the loop divides the loss by the global label-token count
instead, so every layout produces the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from automodel.fsdp2 import default_init_fn, materialize_meta_model
from automodel.mesh import MeshContext
from automodel.recipes.checkpoint import load_pretrained_weights
from automodel.recipes.config.distributed import DistributedSection
from automodel.recipes.config.peft import PeftSection
from automodel.recipes.peft import is_adapter_key, lora_init_fn, read_initial_adapter
from automodel.recipes.strategies import Initialize, ParallelModel, get_strategy
from automodel.recipes.strategies.base import PLAIN_PARTS

__all__ = ["ParallelModel", "parallelize_model"]


def _materialize(
    parts: list[nn.Module], *, device: torch.device, seed: int, peft: PeftSection | None = None
) -> None:
    # LoRA: A as peft.lora_A_init, B zeros, or both from peft.initial_adapter; the rest as without adapters
    initial = read_initial_adapter(peft, parts) if peft is not None and peft.initial_adapter else None
    for part in parts:
        init_fn = None
        if peft is not None:
            config = getattr(part, "config", None)
            std = float(getattr(config, "initializer_range", 0.02) or 0.02)
            init_fn = lora_init_fn(default_init_fn(std), section=peft, initial=initial)
        materialize_meta_model(part, device=device, seed=seed, init_fn=init_fn)


def _weight_initializer(
    *,
    device: torch.device,
    seed: int,
    pretrained_path: str | None,
    allow_pickle_weights: bool,
    peft: PeftSection | None,
) -> Initialize:
    """Materialize parts (seeded like one process), then load the pretrained checkpoint if any.

    LoRA adapters are initialised as LoRA's (B = 0) and are not looked for in the checkpoint.
    """

    def initialize(parts: list[nn.Module]) -> None:
        _materialize(parts, device=device, seed=seed, peft=peft)
        if pretrained_path is None:
            return

        adapters: set[str] = set()
        if peft is not None:
            # every strategy materializes its parts before it wraps them: torch's own state dicts
            adapters = {k for p in parts for k in PLAIN_PARTS.model_state_dict(p) if is_adapter_key(k)}
        load_pretrained_weights(
            parts, pretrained_path, allow_pickle_weights=allow_pickle_weights, optional_keys=adapters
        )

    return initialize


def parallelize_model(
    model: nn.Module,
    *,
    mesh: MeshContext,
    section: DistributedSection,
    device: torch.device,
    seed: int,
    pipeline_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    gradient_divide_factor: float | None = 1.0,
    pretrained_path: str | None = None,
    allow_pickle_weights: bool = False,
    peft: PeftSection | None = None,
) -> ParallelModel:
    """Compose the parallelisms of `section` on `model` (on the meta device) and materialize it.

    Weights are initialised (seeded, identical to one process) or loaded from the HF checkpoint
    at `pretrained_path` straight into the sharded parameters. With pp > 1,
    `pipeline_loss_fn(logits, labels)` runs on the last stage per micro-batch. `peft` is the
    `PeftSection` whose LoRA adapters `model` already carries.
    """
    initialize = _weight_initializer(
        device=device,
        seed=seed,
        pretrained_path=pretrained_path,
        allow_pickle_weights=allow_pickle_weights,
        peft=peft,
    )
    return get_strategy(section.strategy).parallelize(
        model,
        mesh=mesh,
        section=section,
        device=device,
        initialize=initialize,
        gradient_divide_factor=gradient_divide_factor,
        pipeline_loss_fn=pipeline_loss_fn,
    )
