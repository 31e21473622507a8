"""LoRA for the recipes: the ``peft:`` YAML section, the adapter modules, and the PEFT-format export."""

from automodel.recipes.config.peft import PeftSection
from automodel.recipes.peft.export import adapter_config, gather_adapters, save_adapter
from automodel.recipes.peft.initial import check_initial_adapter, read_initial_adapter
from automodel.recipes.peft.lora import (
    LoRAInfo,
    LoRALinear,
    apply_lora,
    is_adapter_key,
    lora_init_fn,
    merged_weight,
    select_linears,
)

__all__ = [
    "LoRAInfo",
    "LoRALinear",
    "PeftSection",
    "adapter_config",
    "apply_lora",
    "check_initial_adapter",
    "gather_adapters",
    "is_adapter_key",
    "lora_init_fn",
    "merged_weight",
    "read_initial_adapter",
    "save_adapter",
    "select_linears",
]
