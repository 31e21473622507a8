"""Adapters in Hugging Face PEFT format: ``adapter_config.json`` + ``adapter_model.safetensors``.

Keys are ``base_model.model.<linear FQN>.lora_A.weight`` / ``lora_B.weight`` (what
``peft.PeftModel.save_pretrained`` writes for a causal LM), so
``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), directory)`` loads
them with no code of ours. Each adapter is gathered to full size by the ranks holding it (a
collective over its own mesh, so pipeline stages gather independently); the lowest such rank
sends it to rank 0, which writes the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from automodel.recipes.peft.lora import LoRAInfo, is_adapter_key

if TYPE_CHECKING:  # strategies -> planning -> peft: the type only
    from automodel.recipes.strategies.base import PartWrapping

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def adapter_config(info: LoRAInfo, *, base_model_name_or_path: str | None) -> dict[str, Any]:
    """The ``LoraConfig`` fields peft reads back (``peft_type: LORA``, ``task_type: CAUSAL_LM``)."""
    s = info.section
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": s.dim,
        "lora_alpha": s.alpha,
        # peft drops the adapter's input; NeMo's default (dropout_position: post) drops its output.
        # Only training differs: both are off at inference.
        "lora_dropout": s.dropout,
        "target_modules": info.peft_target_modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def gather_adapters(model_parts: list[nn.Module], *, strategy: PartWrapping) -> dict[str, torch.Tensor]:
    """Every adapter weight at full size on rank 0 (``{}`` on the other ranks); collective."""

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local: dict[str, tuple[torch.Tensor, nn.Module]] = {}
    for part in model_parts:
        for key, value in strategy.model_state_dict(part).items():
            if is_adapter_key(key):
                local[key] = (value, part)
    held: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(held, sorted(local))
    else:
        held = [sorted(local)]
    sender = {}
    for r, keys in enumerate(held):
        for key in keys:
            sender.setdefault(key, r)
    mine: dict[str, torch.Tensor] = {}
    for key, (value, part) in local.items():  # same order on the ranks sharing a part
        full = strategy.full_tensor(value, part)
        if sender[key] == rank:
            mine[key] = full.detach().to("cpu").contiguous().clone()
    if not dist.is_initialized():
        return mine
    received: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, received, dst=0)
    if rank != 0:
        return {}
    out: dict[str, torch.Tensor] = {}
    for part_dict in received:
        out.update(part_dict)
    return out


def save_adapter(
    *,
    model_parts: list[nn.Module],
    directory: Path,
    info: LoRAInfo,
    base_model_name_or_path: str | None = None,
    strategy: PartWrapping,
) -> list[str]:
    """Write ``directory/adapter_config.json`` and ``adapter_model.safetensors`` (rank 0); collective.

    Returns the file names written.
    """
    tensors = gather_adapters(model_parts, strategy=strategy)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        expected = {
            f"{m}{suffix}" for m in info.module_fqns for suffix in (".lora_A.weight", ".lora_B.weight")
        }
        assert set(tensors) == expected, sorted(set(tensors) ^ expected)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {f"{PEFT_PREFIX}{k}": v for k, v in sorted(tensors.items())},
            str(directory / ADAPTER_WEIGHTS),
            metadata={"format": "pt"},
        )
        config = adapter_config(info, base_model_name_or_path=base_model_name_or_path)
        (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]
