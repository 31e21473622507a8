"""The single-process strategy: the model as it is, with no data-parallel wrapper (a world of one).

A world of one shards nothing and reduces nothing, so FSDP2 would only add its hooks and
DTensors (NeMo AutoModel does no FSDP wrapping on one GPU either). `resolve_machine_defaults`
selects this strategy for a world of one when the YAML names no strategy and no strategy flag and
FSDP2 would change no numerics (its mixed precision computes in the parameters' dtype); the
layout line says so at start-up. ``distributed.strategy: single`` selects it explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from automodel.mesh import MeshContext, ResolvedLayout, StrategyConfig
from automodel.recipes.errors import ConfigError
from automodel.recipes.planning.step import StrategyMemory
from automodel.recipes.strategies.base import Initialize, ParallelModel, Strategy

if TYPE_CHECKING:
    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.parallelisms import Parallelism


@dataclass(frozen=True)
class SingleConfig(StrategyConfig):
    """Flags of the single-process strategy: only the process-group backend."""

    backend: str = "gloo"


class SingleStrategy(Strategy[SingleConfig]):
    """One process, parameters as plain tensors: materialize and train the model itself."""

    name = "single"
    supported_axes = ("dp_shard", "dp_replicate")  # any size > 1 is refused by `check_sizes`
    for_world_of_one = True

    def config_class(self) -> type[SingleConfig]:
        return SingleConfig

    def axis_refusal(self, parallelism: Parallelism) -> str:
        return f"strategy {self.name} trains one process (must be 1)"

    def check_sizes(
        self, sizes: dict[str, int | None], options: dict[str, Any], config: SingleConfig
    ) -> None:
        for key, value in sizes.items():
            if value is not None and value > 1:
                raise ConfigError(
                    f"distributed.{key}", value, f"strategy {self.name} trains one process (must be 1)"
                )

    def check_layout(self, layout: ResolvedLayout) -> None:
        if layout.world_size != 1:
            raise ConfigError(
                "distributed.strategy",
                self.name,
                f"trains one process without a data-parallel wrapper, but the world has "
                f"{layout.world_size} ranks; use fsdp2 or ddp",
            )

    def memory_model(self, config: SingleConfig) -> StrategyMemory:
        """Everything on the one rank; nothing gathered or reduced."""
        return StrategyMemory(
            shard_over="none",
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
        return ParallelModel(parts=[model], strategy=self, defer_grad_sync=False)
