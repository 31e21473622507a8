"""Expert parallelism (``distributed.ep_size``, options in ``distributed.moe`` -> automodel.moe's
`MoEParallelizerConfig`): each MoE layer's experts split over ep ranks of the MoE mesh."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from automodel.mesh import MeshContext, ResolvedLayout, StrategyConfig
from automodel.moe import (
    ExpertLoad,
    MoEParallelizerConfig,
    check_expert_parallel_support,
    parallelize_experts,
    validate_moe_layout,
)
from automodel.recipes.errors import ConfigError
from automodel.recipes.model import num_experts
from automodel.recipes.parallelisms.base import (
    ActivationSite,
    MemoryShares,
    MetaModel,
    ModelChecks,
    Options,
    Parallelism,
    PlanColumn,
    SearchPoint,
    StageBuild,
    StepMeter,
    config_error,
    divisors,
    section_mapping,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.shape import ModelShape
    from automodel.recipes.planning.step import StepSetup, StepTraffic


def build_moe_config(moe: Options | None) -> MoEParallelizerConfig:
    """`MoEParallelizerConfig` from ``distributed.moe`` (errors name the key)."""
    options = dict(moe or {})
    try:
        return MoEParallelizerConfig(**options)
    except (ValueError, TypeError) as e:
        raise config_error("distributed.moe", options, e) from None


class _ExpertLoadMeter:
    """automodel.moe's `ExpertLoad` over one step: the ep group's busiest rank's routed rows over
    the mean (`StepSetup.expert_load_factor`)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.load = ExpertLoad()
        self.group = group

    def __enter__(self) -> _ExpertLoadMeter:
        self.load.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.load.__exit__(*exc)

    def fields(self) -> dict[str, float]:
        return {"expert_load_factor": self.load.load_factor(group=self.group)}


def expert_load(setup: StepSetup) -> float:
    """The busiest rank's routed slots over its balanced share: 1 without EP, at most ep."""
    ep = setup.size_of("ep")
    return min(setup.expert_load_factor, ep) if ep > 1 else 1.0


class ExpertParallel(Parallelism[MoEParallelizerConfig]):
    """Experts over ep ranks, each expert's shard over ep_shard (the rest of dp x cp)."""

    name = "ep"
    size_key = "ep_size"
    section_key = "moe"
    report_axes = ("ep", "ep_shard")
    search_order = 3
    apply_phase = 30
    plan_column = PlanColumn("ep", 3)

    def check_sizes(
        self, *, sizes: Mapping[str, int | None], data: Mapping[str, object], strategy_config: StrategyConfig
    ) -> None:
        section_mapping(data, "moe")

    def config_class(self) -> type[MoEParallelizerConfig]:
        return MoEParallelizerConfig

    def build_config(
        self, options: Options | None, *, size: int | None, local_batch_size: int
    ) -> MoEParallelizerConfig | None:
        if size == 1 and options is not None:
            warnings.warn("distributed.moe is ignored because ep_size == 1", stacklevel=3)
        return build_moe_config(options) if size is not None and size > 1 else None

    def check_model(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig, size: int
    ) -> None:
        if size == 1:
            return
        experts = num_experts(hf_config)
        if experts is None:
            raise ConfigError(
                "distributed.ep_size", size, f"needs an MoE model; {hf_config.model_type} has no experts"
            )
        if experts % size:
            raise ConfigError(
                "distributed.ep_size", size, f"must divide the model's number of experts ({experts})"
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
        """automodel.moe's own rule (the one apply_ep enforces in the ranks), on the meta model."""
        if size == 1:
            return
        try:
            blocks = check_expert_parallel_support(meta_model(), declared_experts=num_experts(hf_config))
            validate_moe_layout(layout=layout, num_experts=[b.num_experts for b in blocks])
        except ValueError as e:
            raise self.cannot_apply(size, f"model_type {hf_config.model_type!r}: {e}") from None

    def apply_to_stage(self, module: torch.nn.Module, *, build: StageBuild, size: int) -> None:
        """automodel.moe splits the experts over ``ep`` and names them: units the sharding wraps
        apart, over ``ep_shard``."""
        if size > 1:
            build.expert_units = parallelize_experts(
                module,
                mesh=build.mesh,
                gradient_divide_factor=build.gradient_divide_factor,
                pipeline_stage=build.pipeline_stage,  # a stage may hold dense layers only
            )

    def step_meter(self, mesh: MeshContext, *, size: int) -> StepMeter | None:
        """The routed load of the ep group's busiest rank (the estimate's expert load factor)."""
        return _ExpertLoadMeter(mesh.get_mesh("ep").get_group()) if size > 1 else None

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        """Divisors of the experts that divide the dp x cp ranks left (ep_shard = dp*cp / ep)."""
        if not point.shape.is_moe:
            return [{self.name: 1}]
        dp_cp = point.room * point.sizes.get("cp", 1)
        return [{self.name: e} for e in divisors(point.shape.experts) if e <= dp_cp and dp_cp % e == 0]

    def validate_lines(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, size: int, stages: int, setup: StepSetup
    ) -> list[str]:
        if size == 1:
            return []
        return [
            f"expert load factor {expert_load(setup):g} (the busiest ep rank's routed tokens "
            "over the mean; --moe-load-factor)"
        ]

    def step_fields(self, *, section: DistributedSection, size: int, stages: int) -> dict[str, object]:
        moe = section.moe_config
        return (
            {"reshard_after_forward": bool(moe.reshard_after_forward)} if size > 1 and moe is not None else {}
        )

    def search_options(self, *, size: int, shape: ModelShape) -> list[dict[str, object]]:
        """moe.reshard_after_forward: False (the default) keeps every layer's gathered weights from
        forward to backward, True frees them and gathers again in backward."""
        if size == 1:
            return [{}]
        return [{"reshard_after_forward": False}, {"reshard_after_forward": True}]

    def plan_yaml_section(self, setup: StepSetup) -> list[str]:
        if setup.ep == 1:
            return []
        return [f"  moe: {{reshard_after_forward: {'true' if setup.reshard_after_forward else 'false'}}}"]

    def memory_shares(self, *, size: int, setup: StepSetup, shape: ModelShape) -> MemoryShares:
        """The experts' weights over ep; the busiest rank computes `expert_load` times
        its balanced share of the routed slots (the router decides it at run time)."""
        if size == 1:
            return MemoryShares()
        return MemoryShares(experts=size, expert_load=expert_load(setup))

    def expert_shard_ranks(self, *, size: int, setup: StepSetup) -> int | None:
        """The experts it splits off are sharded over ``ep_shard``: the other dp x cp ranks."""
        return setup.dp_cp // size if size > 1 else None

    def layer_activation_terms(
        self, *, size: int, setup: StepSetup, shape: ModelShape, shares: MemoryShares, moe: bool
    ) -> dict[ActivationSite, float]:
        """The dispatched copy of each routed slot, on its expert's owner."""
        if size == 1 or not moe:
            return {}
        return {"experts": shape.top_k * setup.compute_bytes * shape.hidden * shares.expert_load}

    def exposed_comm_s(self, traffic: StepTraffic) -> float:
        """Token dispatch and combine, forward and backward (the busiest rank's load)."""
        t, s, shape = traffic, traffic.setup, traffic.shape
        if not (s.ep > 1 and shape.is_moe):
            return 0.0
        moved = (
            4
            * t.mb_tokens
            * shape.top_k
            * shape.hidden
            * s.compute_bytes
            * (s.ep - 1)
            / s.ep
            * expert_load(s)
        )
        return shape.moe_layers / s.pp * t.micro_batches * moved / t.bandwidth(s.ep * s.cp * s.tp)
