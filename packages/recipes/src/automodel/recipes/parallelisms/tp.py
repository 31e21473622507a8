"""Tensor parallelism (``distributed.tp_size``), and sequence parallelism inside its regions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from automodel.mesh import ResolvedLayout, StrategyConfig
from automodel.mesh.model_parts import positive_ints, text_config
from automodel.recipes.errors import ConfigError
from automodel.recipes.model import num_experts
from automodel.recipes.parallelisms.base import (
    ActivationSite,
    MemoryShares,
    Parallelism,
    PlanColumn,
    SearchPoint,
    divisors,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.memory import StepSetup
    from automodel.recipes.planning.roofline import StepTraffic
    from automodel.recipes.planning.shape import ModelShape


class TensorParallel(Parallelism):
    """Heads, KV heads and the vocabulary split over tp ranks."""

    name = "tp"
    size_key = "tp_size"
    report_axes = ("tp",)
    search_order = 0
    plan_column = PlanColumn("tp", 3)

    def check_sizes(
        self, *, sizes: Mapping[str, int | None], data: Mapping[str, object], strategy_config: StrategyConfig
    ) -> None:
        sp = strategy_config.sequence_parallel_enabled
        if sp and sizes[self.size_key] == 1:
            raise ConfigError(
                "distributed.sequence_parallel",
                sp,
                "needs tp_size > 1 (sequence parallelism splits TP regions)",
            )

    def check_model(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig, size: int
    ) -> None:
        if size == 1:
            return
        text = text_config(hf_config)  # a multimodal model's text decoder
        # every layer's count (a heterogeneous config's layers may differ)
        for key in ("num_attention_heads", "num_key_value_heads"):
            for count in positive_ints(text, key):
                if count % size:
                    raise ConfigError("distributed.tp_size", size, f"must divide model {key}={count}")
        vocab = getattr(text, "vocab_size", None)
        if vocab is not None and vocab % size:
            raise ConfigError("distributed.tp_size", size, f"must divide model vocab_size={vocab}")
        d = cfg.distributed
        if d.sequence_parallel and d.tp_plan is None and num_experts(hf_config):
            raise ConfigError(
                "distributed.sequence_parallel",
                True,
                f"is not supported for MoE models ({hf_config.model_type}: the expert block has no "
                "sequence-parallel plan); use tp_size > 1 without it",
            )

    def seq_multiple(self, *, cfg: RecipeConfig, layout: ResolvedLayout, size: int) -> int:
        """tp under sequence parallelism: the norms' regions hold equal shares of the sequence (a
        ``seq_length`` that is not a multiple still runs, in uneven shards; a padded micro-batch
        is rounded up to equal ones)."""
        return size if size > 1 and cfg.distributed.sequence_parallel else 1

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        """Inside one node (its collectives are on the critical path of every layer)."""
        return [{self.name: d} for d in divisors(min(point.room, point.gpus_per_node))]

    def search_options(self, *, size: int, shape: ModelShape) -> list[dict[str, object]]:
        """Sequence parallelism with TP, but for MoE models (their expert block has no SP plan)."""
        return [{"sequence_parallel": size > 1 and not shape.is_moe}]

    def memory_shares(self, *, size: int, setup: StepSetup, shape: ModelShape) -> MemoryShares:
        """Heads, MLP width, the untied head and the dense weights over tp; the norms' hidden
        states too under sequence parallelism; the experts' weights unless EP owns them."""
        return MemoryShares(
            heads=size,
            norm_width=size if setup.sequence_parallel else 1,
            experts=size if setup.ep == 1 else 1,
        )

    def layer_activation_terms(
        self, *, size: int, setup: StepSetup, shape: ModelShape, shares: MemoryShares, moe: bool
    ) -> dict[ActivationSite, float]:
        """Sequence parallelism: the all-gathered norm outputs the column-parallel linears keep."""
        if not setup.sequence_parallel:
            return {}
        return {"norms": 2 * setup.compute_bytes * shape.hidden}

    def exposed_comm_s(self, traffic: StepTraffic) -> float:
        """2 collectives forward, 2 backward per layer (+2 for the recompute)."""
        t, s = traffic, traffic.setup
        if s.tp == 1:
            return 0.0
        n = (6 if s.activation_checkpointing else 4) * t.layers_rank * t.micro_batches
        return n * 2 * (s.tp - 1) / s.tp * t.mb_tokens * t.shape.hidden * s.compute_bytes / t.bandwidth(s.tp)
