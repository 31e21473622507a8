"""What a training loop does differently around a ``MegatronFSDP`` model: micro-batch gradient
sync, and state dicts with uneven shards (for DCP and for full-tensor export)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def is_megatron_fsdp(module: nn.Module) -> bool:
    """True for the wrapper `apply_megatron_fsdp` returns (checked by its buffer, no import)."""
    return hasattr(module, "param_and_grad_buffer") and hasattr(module, "finish_grad_sync")


@contextmanager
def microbatch_grad_sync(model: nn.Module, *, is_last_microbatch: bool) -> Iterator[None]:
    """Backward passes inside accumulate; on the last micro-batch gradients are reduced and attached.

    On the last micro-batch megatron-fsdp reduces the gradient buffer over its dp group and hands
    the reduced shards to the optimizer's parameters as ``.grad`` (``finish_grad_sync``), so the
    gradient norm can be taken before ``optimizer.step()``. Earlier micro-batches keep the local
    sum (no_shard / optim) or reduce-scatter into the shard (optim_grads / optim_grads_params).
    """
    model.is_last_microbatch = is_last_microbatch
    model.model_auto_sync = is_last_microbatch
    try:
        yield
    finally:
        model.is_last_microbatch = True
        model.model_auto_sync = True


def model_state_dict(model: nn.Module) -> dict[str, Any]:
    """FQN -> DTensor of the wrapped module (Hugging Face names, no ``module.`` prefix), with the
    chunk metadata DCP needs for megatron-fsdp's uneven shards."""
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    model._replace_param_with_distributed_if_needed()
    return preprocess_state_dict_for_uneven_dtensor(model.module.state_dict())


def prepare_state_dict_for_dcp(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Attach uneven-shard chunk metadata to every DTensor of `state_dict` (collective)."""
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    return preprocess_state_dict_for_uneven_dtensor(state_dict)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a megatron-fsdp DTensor (uneven shards gathered; collective)."""
    from torch.distributed.tensor import DTensor

    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

    return uneven_dtensor_to_full_tensor(t) if isinstance(t, DTensor) else t
