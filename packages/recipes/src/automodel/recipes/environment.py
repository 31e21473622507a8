"""Refuse, before any rank starts, what this machine cannot run (never a silent fallback)."""

from __future__ import annotations

from automodel.recipes.errors import ConfigError
from automodel.recipes.recipe_config import RecipeConfig


def check_environment(cfg: RecipeConfig) -> None:
    """`ConfigError` naming the key when the configured strategy cannot run here.

    `recipes validate` does not call this: it plans layouts for clusters it is not running on.
    """
    if cfg.distributed.strategy == "megatron_fsdp":
        from automodel.megatron_fsdp import MegatronFSDPUnavailableError, import_megatron_fsdp

        try:
            import_megatron_fsdp()
        except MegatronFSDPUnavailableError as e:
            raise ConfigError("distributed.strategy", "megatron_fsdp", str(e)) from None
