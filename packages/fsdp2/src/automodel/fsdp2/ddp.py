"""`DDPManager`: plain data parallelism (``strategy: ddp``), optionally summing gradients."""

from __future__ import annotations

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
    ddp = DistributedDataParallel(model, process_group=group, device_ids=device_ids, **ddp_kwargs)
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
