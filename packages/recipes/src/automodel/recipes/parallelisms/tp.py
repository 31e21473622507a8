"""Tensor parallelism (``distributed.tp_size``), and sequence parallelism inside its regions.

Its options are its own typed config, `automodel.fsdp2.TensorParallelConfig`, built once from
NeMo AutoModel's flat keys (``distributed.sequence_parallel``, ``tp_plan``,
``enable_async_tensor_parallel``: `TensorParallel.flag_keys`), not the strategy's flags. FSDP2 runs
it as the first phase of its stack (`apply_to_stage`); megatron-fsdp applies TP inside its own
wrapper and is handed this config (`tensor_parallel_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import Shard

from automodel.fsdp2 import FSDP2Config, TensorParallelConfig, apply_tensor_parallel_from_config
from automodel.fsdp2.tp_plan import (
    check_plan_matches_model,
    check_plan_shards_every_layer,
    plan_has_sequence_parallel,
    resolve_tp_plan,
)
from automodel.mesh import MeshContext, ResolvedLayout
from automodel.mesh.model_parts import positive_ints, text_config
from automodel.recipes.errors import ConfigError
from automodel.recipes.model import num_experts
from automodel.recipes.parallelisms.base import (
    ActivationSite,
    KernelKind,
    MemoryShares,
    MetaModel,
    ModelChecks,
    Options,
    Parallelism,
    PlanColumn,
    SearchPoint,
    StageBuild,
    checked_once,
    config_error,
    divisors,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.pipeline import BoundaryLayout
    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.shape import ModelShape
    from automodel.recipes.planning.step import StepSetup, StepTraffic


def tensor_parallel_config(configs: Mapping[str, object]) -> TensorParallelConfig:
    """The tp parallelism's config among the section's `parallelism_configs` (the defaults when
    the section has none: a section built by hand)."""
    config = configs.get(TensorParallel.name)
    return config if isinstance(config, TensorParallelConfig) else TensorParallelConfig()


def shards_sequence(model: torch.nn.Module, *, configs: Mapping[str, object]) -> bool:
    """Whether the TP plan this model gets (the YAML's, the model's own, or the default) shards the
    sequence: then the hidden states between pipeline stages are sequence shards."""
    config = tensor_parallel_config(configs)
    plan = resolve_tp_plan(model, tp_plan=config.tp_plan, sequence_parallel=config.sequence_parallel)
    return plan_has_sequence_parallel(plan)


class TensorParallel(Parallelism[TensorParallelConfig]):
    """Heads, KV heads and the vocabulary split over tp ranks."""

    name = "tp"
    size_key = "tp_size"
    flag_keys = ("sequence_parallel", "tp_plan", "enable_async_tensor_parallel")
    report_axes = ("tp",)
    search_order = 0
    apply_phase = 10
    plan_column = PlanColumn("tp", 3)

    def config_class(self) -> type[TensorParallelConfig]:
        return TensorParallelConfig

    def build_config(
        self, options: Options | None, *, size: int | None, local_batch_size: int
    ) -> TensorParallelConfig:
        """Built at every size (its keys mean the same whatever the strategy); sequence
        parallelism (async TP turns it on) needs tp_size > 1."""
        values: dict[str, Any] = dict(options or {})  # the YAML's values: the config checks them
        try:
            config = TensorParallelConfig(**values)
        except (ValueError, TypeError) as e:
            raise config_error("distributed", values, e) from None
        if config.sequence_parallel and size == 1:
            raise ConfigError(
                "distributed.sequence_parallel",
                True,
                "needs tp_size > 1 (sequence parallelism splits TP regions)",
            )
        return config

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
        config = tensor_parallel_config(cfg.distributed.parallelism_configs)
        if config.sequence_parallel and config.tp_plan is None and num_experts(hf_config):
            raise ConfigError(
                "distributed.sequence_parallel",
                True,
                f"is not supported for MoE models ({hf_config.model_type}: the expert block has no "
                "sequence-parallel plan); use tp_size > 1 without it",
            )

    def check_meta_model(
        self,
        *,
        cfg: RecipeConfig,
        layout: ResolvedLayout,
        hf_config: PretrainedConfig,
        size: int,
        meta_model: MetaModel,
        memo: ModelChecks | None,
    ) -> None:
        """The TP plan (the YAML's, the model's own, or the default) matches the model's modules and
        shards every decoder layer (megatron_fsdp applies TP with the same plan rules)."""
        if size == 1:
            return
        config = tensor_parallel_config(cfg.distributed.parallelism_configs)

        def check() -> None:
            model = meta_model()
            plan = resolve_tp_plan(model, tp_plan=config.tp_plan, sequence_parallel=config.sequence_parallel)
            check_plan_matches_model(model, plan)
            check_plan_shards_every_layer(model, plan)

        error = checked_once(memo, (self.name, repr(config.tp_plan), config.sequence_parallel), check)
        if error is not None:
            raise self.cannot_apply(size, error)

    def apply_to_stage(self, module: torch.nn.Module, *, build: StageBuild, size: int) -> None:
        """The packed-sequence patch, then TP/SP over ``tp`` with its own config (automodel.fsdp2's
        first half)."""
        config = build.strategy_config
        assert isinstance(config, FSDP2Config), "the per-part phases run under the FSDP2 strategy"
        apply_tensor_parallel_from_config(
            module,
            mesh=build.mesh,
            config=config,
            tensor_parallel=tensor_parallel_config(build.parallelism_configs),
        )

    def part_boundary(
        self, model: torch.nn.Module, *, mesh: MeshContext, section: DistributedSection, size: int
    ) -> BoundaryLayout | None:
        """When the TP plan shards the sequence, the residual stream between model parts is a
        ``Shard(1)`` DTensor over tp; None without sequence parallelism (plain tensors cross)."""
        if size == 1 or not shards_sequence(model, configs=section.parallelism_configs):
            return None
        # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
        from automodel.pipeline import BoundaryLayout

        return BoundaryLayout(mesh=mesh.get_mesh(self.name), placements=(Shard(1),))

    def kernel_refusal(self, kernel: KernelKind) -> tuple[str, str] | None:
        if kernel == "liger":
            return (
                "tensor parallelism",
                "Liger's kernels take plain tensors, sequence parallelism hands them DTensors, and its "
                "fused linear cross-entropy has no vocabulary-sharded head",
            )
        return (
            "tensor parallelism",
            "float8 linears need torchao's float8 TP styles, which this project's TP plans do not use",
        )

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        """Inside one node (its collectives are on the critical path of every layer)."""
        return [{self.name: d} for d in divisors(min(point.room, point.gpus_per_node))]

    def step_fields(self, *, section: DistributedSection, size: int, stages: int) -> dict[str, object]:
        return {"sequence_parallel": tensor_parallel_config(section.parallelism_configs).sequence_parallel}

    def search_options(self, *, size: int, shape: ModelShape) -> list[dict[str, object]]:
        """Sequence parallelism with TP, but for MoE models (their expert block has no SP plan)."""
        return [{"sequence_parallel": size > 1 and not shape.is_moe}]

    def plan_yaml(self, setup: StepSetup) -> list[str]:
        """Its size key when > 1, and ``sequence_parallel: true`` when the plan uses it."""
        return super().plan_yaml(setup) + (["  sequence_parallel: true"] if setup.sequence_parallel else [])

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
