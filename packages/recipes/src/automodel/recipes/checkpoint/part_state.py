"""State dicts of one model part, whatever wraps it: FSDP2 / DDP / plain modules through torch's
`get_model_state_dict`, a megatron-fsdp wrapper through its inner module with uneven-shard
metadata. Keys are always the Hugging Face FQNs, so checkpoints load across strategies."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from automodel.megatron_fsdp import full_tensor as megatron_full_tensor
from automodel.megatron_fsdp import is_megatron_fsdp, model_state_dict


def state_module(part: nn.Module) -> nn.Module:
    """The module whose ``named_parameters`` carry HF names and the optimizer's parameters."""
    if is_megatron_fsdp(part):
        part._replace_param_with_distributed_if_needed()  # pyright: ignore[reportCallIssue]  # megatron-fsdp's method
        return part.get_submodule("module")
    return part


def part_model_state_dict(part: nn.Module) -> dict[str, Any]:
    """FQN -> (sharded) tensor of one part, ready for DCP."""
    if is_megatron_fsdp(part):
        return model_state_dict(part)
    return get_model_state_dict(part)


def full_tensor(t: torch.Tensor, part: nn.Module) -> torch.Tensor:
    """The whole tensor (a collective over the ranks that share `t`)."""
    if not isinstance(t, DTensor):
        return t
    if is_megatron_fsdp(part):
        return megatron_full_tensor(t)
    return t.full_tensor()
