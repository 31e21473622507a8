"""Activation checkpointing of transformer blocks that can replay the router's decisions.

Recomputing a MoE block in backward recomputes its router. If the recomputed top-k differs from
the original one (bf16 ties, non-deterministic kernels), tokens go to other experts, all-to-all
sizes change, and gradients are wrong or ranks hang. With ``save_router_decisions`` the original
forward records the indices of every ``topk`` in the block and the recomputation returns exactly
those indices (values gathered from the recomputed probabilities, so gradients still flow).
Each checkpointed call gets its own record, so micro-batches may be recomputed in any order.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

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


def _plain_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def checkpoint_module(module: nn.Module, *, save_router_decisions: bool) -> None:
    """Recompute `module`'s forward in backward (non-reentrant); its parameter names do not change.

    Marks `module` with ``_recomputed_in_backward`` (there is no checkpoint wrapper to see)."""
    inner = module.forward
    context_fn = _router_replay_contexts if save_router_decisions else _plain_contexts

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    module.forward = forward
    module._recomputed_in_backward = True  # what layout reports look for (no wrapper module here)


def apply_ac(layers: list[nn.Module], *, save_router_decisions: bool) -> None:
    """Checkpoint each transformer block in `layers` (applied before FSDP, as the composition order says)."""
    for layer in layers:
        checkpoint_module(layer, save_router_decisions=save_router_decisions)
