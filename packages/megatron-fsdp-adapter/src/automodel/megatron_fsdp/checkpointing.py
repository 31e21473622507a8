"""Activation checkpointing of the MLP of each unit module (Megatron-FSDP's AC scope: the MLP only)."""

from __future__ import annotations

from torch import nn

from automodel.megatron_fsdp.torch_internals import CHECKPOINT_WRAPPED, non_reentrant_checkpoint_wrapper


def apply_mlp_checkpointing(model: nn.Module, *, unit_modules: list[type[nn.Module]]) -> int:
    """Wrap the ``mlp`` of every `unit_modules` instance in a non-reentrant checkpoint wrapper.

    Only the MLP is recomputed: its activations are the largest part of a layer, and the layer
    itself stays a plain unit for megatron-fsdp's gather/free hooks. Run after TP (plan keys name
    ``...mlp.gate_proj``) and before megatron-fsdp. Returns how many MLPs were wrapped.
    """
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache = False  # recomputation would append to a KV cache twice
    units = tuple(unit_modules)
    wrapped = 0
    for module in model.modules():
        mlp = getattr(module, "mlp", None)
        if isinstance(module, units) and isinstance(mlp, nn.Module) and not hasattr(mlp, CHECKPOINT_WRAPPED):
            module.mlp = non_reentrant_checkpoint_wrapper(mlp)
            wrapped += 1
    if wrapped == 0:
        names = [u.__name__ for u in units]
        raise ValueError(
            f"activation_checkpointing=True but no {names} module of {type(model).__name__} has an mlp"
        )
    return wrapped
