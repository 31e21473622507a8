"""Activation checkpointing of whole decoder layers (non-reentrant, torchtitan style), for dense
and mixture-of-experts models alike.

Recomputing a MoE block in backward recomputes its router. If the recomputed top-k differs from
the original one (bf16 ties, non-deterministic kernels), tokens go to other experts, expert-parallel
all-to-all sizes change, and gradients are wrong or ranks hang. With ``save_router_decisions`` the
original forward records the indices of every ``topk`` in the block and the recomputation returns
exactly those indices (values gathered from the recomputed probabilities, so gradients still flow).
Each checkpointed call gets its own record, so micro-batches may be recomputed in any order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from automodel.fsdp2.torch_internals import CHECKPOINT_WRAPPED, non_reentrant_checkpoint_wrapper
from automodel.mesh.model_parts import decoder_layers, find_layer_list

_TOPK = (torch.topk, torch.Tensor.topk)


def _topk_dim(args: tuple, kwargs: dict) -> int:
    if "dim" in kwargs:
        return kwargs["dim"]
    return args[2] if len(args) > 2 else -1


class _RecordTopK(TorchFunctionMode):
    """Keep the indices each ``topk`` returns; its values are gathered at those indices."""

    def __init__(self, record: list[torch.Tensor]) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _TOPK:
            return func(*args, **kwargs)
        with torch.no_grad():
            indices = func(*args, **kwargs)[1]
        self.record.append(indices)
        # Same autograd ops as the replay (a gather), so forward and recomputation save alike.
        return torch.return_types.topk((args[0].gather(_topk_dim(args, kwargs), indices), indices))


class _ReplayTopK(TorchFunctionMode):
    """Answer each ``topk`` with the recorded indices, in order."""

    def __init__(self, record: list[torch.Tensor]) -> None:
        super().__init__()
        self.record = record
        self.cursor = 0

    def __torch_function__(
        self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _TOPK:
            return func(*args, **kwargs)
        assert self.cursor < len(self.record), "recomputation called topk more often than the forward"
        indices = self.record[self.cursor]
        self.cursor += 1
        values = args[0].gather(_topk_dim(args, kwargs), indices)
        return torch.return_types.topk((values, indices))


def _router_replay_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    record: list[torch.Tensor] = []
    return _RecordTopK(record), _ReplayTopK(record)


def get_lm_ac_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a language model: its decoder layers, found as every package finds
    them (`automodel.mesh.model_parts.find_layer_list`: ``model.layers``, GPT-2's ``transformer.h``)."""
    return decoder_layers(model)


def apply_activation_checkpointing(model: nn.Module, *, save_router_decisions: bool = False) -> int:
    """Wrap each decoder layer in a non-reentrant checkpoint wrapper; returns how many were wrapped.

    Must run before FSDP so each FSDP unit is the wrapped layer. The KV cache is switched off
    (recomputation would append to it twice). State-dict keys are unchanged.
    `save_router_decisions`: the recomputation replays every ``topk`` of the original forward
    (a MoE router's choices; needed under expert parallelism, harmless elsewhere).
    """
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", None):
        config.use_cache = False
    found = find_layer_list(model)
    if found is None:
        raise ValueError(f"{type(model).__name__} has no ModuleList of decoder layers to checkpoint")
    layers, wrapped = found[1], 0
    replay = {"context_fn": _router_replay_contexts} if save_router_decisions else {}
    # By key: a pipeline stage's list keeps the model's layer indices ("2", "3", ...); a layer held
    # under two keys is wrapped under each, as before (named_children would list it once).
    children = [(k, m) for k, m in layers.named_modules(remove_duplicate=False) if k and "." not in k]
    for key, layer in children:
        if _is_checkpoint_wrapped(layer):
            continue
        layers.register_module(key, non_reentrant_checkpoint_wrapper(layer, **replay))
        wrapped += 1
    return wrapped


def _is_checkpoint_wrapped(module: nn.Module) -> bool:
    return hasattr(module, CHECKPOINT_WRAPPED)
