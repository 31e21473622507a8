"""The DDP strategy: data parallelism only; weights first (DDP broadcasts real parameters), then the wrapper."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from automodel.fsdp2 import DDPConfig, DDPManager, apply_activation_checkpointing
from automodel.mesh import MeshContext
from automodel.recipes.parallelisms.roles import batch_ranks
from automodel.recipes.planning.step import StrategyMemory
from automodel.recipes.strategies.base import Initialize, ParallelModel, Strategy

if TYPE_CHECKING:
    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.parallelisms import Parallelism


class DDPStrategy(Strategy[DDPConfig]):
    """torch DDP through automodel.fsdp2's `DDPManager` (no wrapper at dp = 1)."""

    name = "ddp"
    layer_flags = ("activation_checkpointing",)
    supported_axes = ("dp_shard",)

    def config_class(self) -> type[DDPConfig]:
        return DDPConfig

    def axis_refusal(self, parallelism: Parallelism) -> str:
        if parallelism.holds_whole_copies:  # HSDP's replicas of a sharded model
            return f"is FSDP2-only (strategy={self.name})"
        return "ddp is data parallelism only (must be 1)"

    def unwrap(self, part: nn.Module) -> nn.Module:
        """The module inside DDP's wrapper (none at dp = 1)."""
        return part.module if isinstance(part, DistributedDataParallel) else part

    def wrapper_lines(self, part: dict[str, Any], *, rank: int) -> list[str]:
        """The DDP reducer the report found (`automodel.mesh.layout_report`: none at dp = 1)."""
        if "ddp" not in part:
            return []
        ddp = part["ddp"]
        return [f"[rank {rank}] {self.name} ({ddp['group_size']} ranks): reducer {ddp['reducer']}"]

    def memory_model(self, config: DDPConfig) -> StrategyMemory:
        """Replicated; gradients in flat buckets, all-reduced as they appear."""
        return StrategyMemory(
            shard_over="none",
            gradient_buckets=True,
            gathered_weights="none",
            reduce_scatter_in_flight=False,
            defer_unsharded_grads=False,
        )

    def parallelize(
        self,
        model: nn.Module,
        *,
        mesh: MeshContext,
        section: DistributedSection,
        device: torch.device,
        initialize: Initialize,
        gradient_divide_factor: float | None,
        pipeline_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    ) -> ParallelModel:
        initialize([model])
        config = section.strategy_config
        assert isinstance(config, DDPConfig)
        if batch_ranks(mesh.layout) == 1:  # no wrapper, but the flags still apply (the planner counts them)
            if config.activation_checkpointing:
                apply_activation_checkpointing(model)
            return ParallelModel(parts=[model], strategy=self, defer_grad_sync=False)
        manager = DDPManager(config, mesh, gradient_divide_factor=gradient_divide_factor)
        return ParallelModel(parts=[manager.parallelize(model)], strategy=self, defer_grad_sync=True)
