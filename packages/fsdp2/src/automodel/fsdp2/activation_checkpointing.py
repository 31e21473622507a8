"""Activation checkpointing of whole decoder layers (non-reentrant, torchtitan style)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from automodel.mesh.model_parts import decoder_layers, find_layer_list


def get_lm_ac_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a language model: its decoder layers, found as every package finds
    them (`automodel.mesh.model_parts.find_layer_list`: ``model.layers``, GPT-2's ``transformer.h``)."""
    return decoder_layers(model)


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wrap each decoder layer in a non-reentrant checkpoint wrapper; returns how many were wrapped.

    Must run before FSDP so each FSDP unit is the wrapped layer. The KV cache is switched off
    (recomputation would append to it twice). State-dict keys are unchanged.
    """
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache = False
    found = find_layer_list(model)
    if found is None:
        raise ValueError(f"{type(model).__name__} has no ModuleList of decoder layers to checkpoint")
    layers, wrapped = found[1], 0
    # By key: a pipeline stage's list keeps the model's layer indices ("2", "3", ...).
    for key, layer in list(layers._modules.items()):
        if layer is None or _is_checkpoint_wrapped(layer):
            continue
        layers._modules[key] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        wrapped += 1
    return wrapped


def _is_checkpoint_wrapped(module: nn.Module) -> bool:
    return hasattr(module, "_checkpoint_wrapped_module")
