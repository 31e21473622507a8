"""Gradient-sync deferral for gradient accumulation, for FSDP2 and DDP models alike."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel


def set_gradient_sync(model: nn.Module, *, enabled: bool) -> None:
    """Turn the data-parallel gradient reduction of the next backward on or off."""
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = enabled
        return
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_requires_gradient_sync(enabled, recurse=False)


@contextmanager
def grad_sync_context(model: nn.Module, *, is_last_microbatch: bool, enabled: bool = True) -> Iterator[None]:
    """Wrap forward and backward of one micro-batch: reduce gradients only on the last one.

    Earlier micro-batches accumulate unreduced local gradients (no communication); the last
    backward reduces the sum. ``enabled=False`` (``defer_fsdp_grad_sync: false``) syncs every time.
    Sync is switched back on when the block exits.
    """
    defer = enabled and not is_last_microbatch
    if not defer:
        yield
        return
    set_gradient_sync(model, enabled=False)
    try:
        yield
    finally:
        set_gradient_sync(model, enabled=True)
