"""`DDPManager`: plain data parallelism (``strategy: ddp``), optionally summing gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from automodel.fsdp2.activation_checkpointing import apply_activation_checkpointing
from automodel.fsdp2.config import DDPConfig
from automodel.mesh import MeshContext


def _scaled_allreduce_hook(factor: float):
    # No annotations: DDP checks them by identity, and this module's annotations are strings.
    def hook(group, bucket):
        buffer = bucket.buffer()
        if factor != 1.0:
            buffer.div_(factor)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    return hook


def _sync_initial_state(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Give every rank the group's first rank's parameters and buffers, broadcast in place.

    DDP's own initial sync broadcasts a flattened copy of all states; the collective's worker thread
    may drop the last reference to that copy outside the allocator profiler's view, which made the
    profiled peak of the same run differ by the copy's size between runs. In-place broadcasts make no
    copy. Shapes are checked first (collectively) so a mismatch raises instead of hanging in gloo."""
    states = list(dict.fromkeys([*model.parameters(), *model.buffers()]))
    device = states[0].device if states else torch.device("cpu")
    signature = torch.tensor(
        [len(states), sum(t.numel() for t in states), sum(hash(tuple(t.shape)) % 1_000_003 for t in states)],
        dtype=torch.int64,
        device=device,
    )
    low, high = signature.clone(), signature.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        raise ValueError(
            "DDP ranks hold different parameter and buffer shapes (count, elements, shape checksum: "
            f"this rank {signature.tolist()}, group min {low.tolist()}, max {high.tolist()}); every "
            "data-parallel rank must build the same model"
        )
    source = dist.get_global_rank(group, 0)
    for tensor in states:
        dist.broadcast(tensor.detach(), src=source, group=group)


def apply_ddp(
    model: nn.Module, *, dp_mesh, gradient_divide_factor: float | None = None, **ddp_kwargs
) -> DistributedDataParallel:
    """Wrap `model` in DDP over `dp_mesh`; ``gradient_divide_factor=1.0`` sums instead of averaging."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            "DDP needs materialized parameters (it broadcasts rank 0's); call materialize_meta_model first"
        )
    if gradient_divide_factor is not None and gradient_divide_factor <= 0:
        raise ValueError(f"gradient_divide_factor must be > 0 or None, got {gradient_divide_factor}")
    group = dp_mesh.get_group()
    device = next(model.parameters()).device
    device_ids = [device] if device.type == "cuda" else None
    if ddp_kwargs.pop("init_sync", True):
        _sync_initial_state(model, group)
    ddp = DistributedDataParallel(
        model, process_group=group, device_ids=device_ids, init_sync=False, **ddp_kwargs
    )
    if gradient_divide_factor is not None:
        ddp.register_comm_hook(group, _scaled_allreduce_hook(float(gradient_divide_factor)))
    return ddp


class DDPManager:
    """Applies `DDPConfig` to a model on a pure data-parallel layout."""

    def __init__(
        self, config: DDPConfig, mesh: MeshContext, *, gradient_divide_factor: float | None = None
    ) -> None:
        if not isinstance(config, DDPConfig):
            raise ValueError(f"config must be a DDPConfig, got {type(config).__name__}")
        layout = mesh.layout
        bad = {k: getattr(layout, k) for k in ("tp", "pp", "cp", "ep") if getattr(layout, k) > 1}
        if bad:
            sizes = ", ".join(f"{k}_size={v}" for k, v in bad.items())
            raise ValueError(
                f"strategy 'ddp' supports data parallelism only; got {sizes} (use strategy 'fsdp2')"
            )
        self.config = config
        self.mesh = mesh
        self.gradient_divide_factor = gradient_divide_factor

    def parallelize(self, model: nn.Module) -> DistributedDataParallel:
        """Activation checkpointing (if configured), then DDP over the ``dp`` mesh."""
        if self.config.activation_checkpointing:
            apply_activation_checkpointing(model)
        return apply_ddp(
            model, dp_mesh=self.mesh.get_mesh("dp"), gradient_divide_factor=self.gradient_divide_factor
        )
