"""Activation checkpointing of whole decoder layers (non-reentrant, torchtitan style)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper


def get_lm_ac_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a language model: every element of each ``*layers`` ModuleList."""
    blocks: list[nn.Module] = []
    for _, module in _layer_lists(model):
        blocks.extend(m for m in module if m is not None)
    return blocks


def _layer_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    lists = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rpartition(".")[2] == "layers":
            if not any(name.startswith(f"{outer}.") for outer, _ in lists):
                lists.append((name, module))
    return lists


def apply_activation_checkpointing(model: nn.Module) -> int:
    """Wrap each decoder layer in a non-reentrant checkpoint wrapper; returns how many were wrapped.

    Must run before FSDP so each FSDP unit is the wrapped layer. The KV cache is switched off
    (recomputation would append to it twice). State-dict keys are unchanged.
    """
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache = False
    wrapped = 0
    for _, layers in _layer_lists(model):
        # By key: a pipeline stage's list keeps the model's layer indices ("2", "3", ...).
        for key, layer in list(layers._modules.items()):
            if layer is None or _is_checkpoint_wrapped(layer):
                continue
            layers._modules[key] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
            wrapped += 1
    if wrapped == 0 and not get_lm_ac_layers(model):
        raise ValueError(f"{type(model).__name__} has no '*layers' ModuleList to checkpoint")
    return wrapped


def _is_checkpoint_wrapped(module: nn.Module) -> bool:
    return hasattr(module, "_checkpoint_wrapped_module")
