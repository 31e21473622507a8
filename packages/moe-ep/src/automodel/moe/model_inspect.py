"""Find the parts of a Hugging Face (transformers 5) MoE model that expert parallelism touches.

transformers 5 keeps each sparse block's experts stacked: ``<block>.experts.gate_up_proj`` of shape
[E, 2I, H] and ``<block>.experts.down_proj`` of shape [E, H, I], next to a router ``<block>.gate``
returning ``(logits, top_k_weights, top_k_index)``. Detection is structural (shapes, not class
names) so Mixtral, Qwen2-MoE, Qwen3-MoE and their relatives are found alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class MoEBlock:
    """One sparse MoE block of a model."""

    name: str
    block: nn.Module
    experts: nn.Module
    num_experts: int


def _param(module: nn.Module, name: str) -> torch.Tensor | None:
    value = module._parameters.get(name)
    return value if isinstance(value, torch.Tensor) else None


def is_stacked_experts(module: nn.Module) -> bool:
    """True for an experts module with stacked ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""
    gate_up, down = _param(module, "gate_up_proj"), _param(module, "down_proj")
    if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, two_inter, hidden = gate_up.shape
    return down.shape[0] == experts and down.shape[1] == hidden and two_inter == 2 * down.shape[2]


def check_supported_experts(name: str, experts: nn.Module) -> None:
    """Reject stacked-expert layouts the grouped GEMM does not implement (bias, transposed, interleaved)."""
    unsupported = {
        "has_bias": (getattr(experts, "has_bias", False), False),
        "is_transposed": (getattr(experts, "is_transposed", False), False),
        "is_concatenated": (getattr(experts, "is_concatenated", True), True),
        "has_gate": (getattr(experts, "has_gate", True), True),
        "has_post_expert_norm": (getattr(experts, "has_post_expert_norm", False), False),
    }
    for key, (value, expected) in unsupported.items():
        if value != expected:
            raise ValueError(
                f"experts module {name!r} ({type(experts).__name__}) has {key}={value!r}; expert parallelism "
                f"supports only the concatenated gate/up layout without bias ({key}={expected!r})"
            )
    if not callable(getattr(experts, "act_fn", None)):
        raise ValueError(f"experts module {name!r} ({type(experts).__name__}) has no act_fn")


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every module owning a stacked ``experts`` child, in module order."""
    blocks = []
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module) and is_stacked_experts(experts):
            num_experts = experts.gate_up_proj.shape[0]
            blocks.append(MoEBlock(name=name, block=module, experts=experts, num_experts=num_experts))
    return blocks


def find_decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks: children of the ``layers`` container (ModuleList or ModuleDict)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return [(f"{name}.{child}", layer) for child, layer in module.named_children()]
    return []
