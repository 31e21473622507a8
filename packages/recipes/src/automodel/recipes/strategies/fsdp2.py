"""The FSDP2 strategy: per stage TP/SP -> CP hooks -> EP -> AC -> compile -> FSDP2 -> prefetch ->
autocast, the pipeline split around it when pp > 1 (the parallelism that splits the model into
parts, `Parallelism.split_model`), then materialize (parameters are sharded on
the meta device and filled in place). Dense and MoE models take the same path: EP (automodel.moe)
splits the experts and names them; automodel.fsdp2 checkpoints and shards everything, the experts
as units of their own over ``ep_shard``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from automodel.fsdp2 import (
    FSDP2Config,
    SubmoduleSharding,
    apply_sharding_from_config,
    default_mp_policy,
)
from automodel.fsdp2.fsdp import offload_policy_refusal
from automodel.mesh import MeshContext
from automodel.moe import MoEParallelizerConfig
from automodel.recipes.errors import ConfigError
from automodel.recipes.parallelisms import ModelSplit, StageBuild, in_apply_order, parallelisms
from automodel.recipes.planning.step import StrategyMemory
from automodel.recipes.strategies.base import Initialize, ParallelModel, Strategy

if TYPE_CHECKING:
    from automodel.recipes.config.distributed import DistributedSection


def apply_fsdp2_stack(
    module: nn.Module,
    *,
    mesh: MeshContext,
    config: FSDP2Config,
    moe_config: MoEParallelizerConfig | None,
    gradient_divide_factor: float | None,
    parallelism_configs: Mapping[str, object] | None = None,
    model_part: bool = False,
) -> dict[str, object]:
    """TP/SP -> CP hooks -> EP -> AC -> compile -> FSDP2 -> prefetch -> autocast on one model (or PP stage).

    The model-parallel phases are the registered parallelisms' (`Parallelism.apply_to_stage`, in
    `apply_phase` order: TP/SP, CP, EP); the sharding after them is automodel.fsdp2's. With EP, automodel.moe
    splits the experts over ``ep`` and names them; the second half then shards them as units of
    their own over ``ep_shard`` and the rest as for a dense model, with the `moe_config` options
    (router replay, resharding, the root unit, a head precision). `parallelism_configs` are the phases'
    own typed configs (`DistributedSection.parallelism_configs`: TP's). `model_part`: `module` is one of
    the parts a parallelism split the model into (`Parallelism.split_model`: a pipeline stage).
    Returns what the phases resolved, by parallelism name (`StageBuild.resolved`: CP's attention
    backend).
    """
    layout = mesh.layout
    build = StageBuild(
        mesh=mesh,
        strategy_config=config,
        moe_config=moe_config,
        gradient_divide_factor=gradient_divide_factor,
        pipeline_stage=model_part,
        parallelism_configs=parallelism_configs or {},
    )
    for parallelism in in_apply_order():  # the model-parallel phases, in their declared order
        axis = parallelism.mesh_axis
        parallelism.apply_to_stage(module, build=build, size=layout.axis_size(axis) if axis else 1)
    experts = build.expert_units
    if experts is None:
        apply_sharding_from_config(
            module, mesh=mesh, config=config, gradient_divide_factor=gradient_divide_factor
        )
        return build.resolved
    moe = moe_config if moe_config is not None else MoEParallelizerConfig()
    mp_policy = config.mp_policy if config.mp_policy is not None else moe.mp_policy
    assert mp_policy is None or isinstance(mp_policy, MixedPrecisionPolicy)
    submodules = [
        SubmoduleSharding(
            module=unit.module,
            mesh=unit.mesh,
            shard_placement_fn=unit.shard_placement_fn,
            gradient_divide_factor=unit.gradient_divide_factor,
        )
        for unit in experts
    ]
    lm_head = getattr(module, "lm_head", None)  # None on pipeline stages before the last
    if moe.lm_head_precision is not None and isinstance(lm_head, nn.Module):
        assert isinstance(moe.lm_head_precision, torch.dtype)
        precision = moe.lm_head_precision
        submodules.append(
            SubmoduleSharding(
                module=lm_head,
                mp_policy=MixedPrecisionPolicy(
                    param_dtype=precision, reduce_dtype=torch.float32, output_dtype=precision
                ),
            )
        )
    apply_sharding_from_config(
        module,
        mesh=mesh,
        config=config,
        mp_policy=mp_policy,
        gradient_divide_factor=gradient_divide_factor,
        submodules=submodules,
        save_router_decisions=moe.ignore_router_for_ac,
        reshard_after_forward=moe.reshard_after_forward,
        wrap_root=moe.wrap_outer_model,
    )
    return build.resolved


class FSDP2Strategy(Strategy[FSDP2Config]):
    """automodel.fsdp2's FSDP2 (HSDP with dp_replicate_size), composed with TP/SP, CP, EP and PP."""

    name = "fsdp2"
    planned = True
    supported_axes = ("dp_shard", "dp_replicate", "tp", "pp", "cp", "ep")
    float8_all_gather = True  # fully_shard all-gathers torchao's float8 weights
    machine_keys = ("backend", "mp_policy")
    layer_flags = ("activation_checkpointing", "enable_compile", "enable_fsdp2_prefetch")

    def config_class(self) -> type[FSDP2Config]:
        return FSDP2Config

    def machine_defaults(self, options: dict[str, Any], *, cuda: bool) -> dict[str, Any]:
        """Mixed precision bf16 on CUDA (`default_mp_policy`), full precision on CPU."""
        options = super().machine_defaults(options, cuda=cuda)
        if options.get("mp_policy") is None:
            options["mp_policy"] = default_mp_policy() if cuda else MixedPrecisionPolicy()
        return options

    def check_environment(self, config: FSDP2Config) -> None:
        """Pinned CPU offload needs CUDA: refused here, before any rank starts, not in every rank's
        `automodel.fsdp2.fsdp.check_offload_policy`."""
        assert isinstance(config, FSDP2Config)  # parsed by this strategy's config_class
        reason = offload_policy_refusal(config.offload_policy)
        if reason is not None:
            raise ConfigError("distributed.offload_policy", config.offload_policy, reason)

    def needed_alone(self, config: FSDP2Config, *, param_dtype: torch.dtype) -> bool:
        """Alone, FSDP2 matters only through its mixed precision: compute in another dtype than the
        parameters' (bf16 over fp32 weights on CUDA by default)."""
        compute = config.compute_dtype
        return compute is not None and compute != param_dtype

    def memory_model(self, config: FSDP2Config) -> StrategyMemory:
        """Sharded over dp_shard x cp (experts over ep_shard), one unit per layer; deferred sync
        accumulates unsharded gradients."""
        return StrategyMemory(shard_over="copies", defer_unsharded_grads=bool(config.defer_fsdp_grad_sync))

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
        config = section.strategy_config
        assert isinstance(config, FSDP2Config)  # parsed by this strategy's config_class
        resolved: dict[str, object] = {}

        def parallelize_part(module: nn.Module, *, model_part: bool) -> None:
            resolved.update(
                apply_fsdp2_stack(
                    module,
                    mesh=mesh,
                    config=config,
                    moe_config=section.moe_config,
                    gradient_divide_factor=gradient_divide_factor,
                    parallelism_configs=section.parallelism_configs,
                    model_part=model_part,
                )
            )

        split = ModelSplit(
            mesh=mesh,
            section=section,
            device=device,
            loss_fn=pipeline_loss_fn,
            build_part=lambda module: parallelize_part(module, model_part=True),
        )
        parts = [model]
        splitter = None
        for parallelism in parallelisms():  # the first that splits the model into parts (pp's stages)
            found = parallelism.split_model(model, split=split, size=parallelism.size(section, mesh.layout))
            if found is not None:
                parts, resolved[parallelism.name] = found  # its own entry (`PipelineParallel.pipeline`)
                splitter = parallelism
                break
        if splitter is None:
            parallelize_part(model, model_part=False)
        initialize(parts)
        return ParallelModel(
            parts=parts,
            strategy=self,
            resolved=resolved,
            # A split model's schedule (the pipeline's) reduces gradients itself after its last
            # micro-batch.
            defer_grad_sync=splitter is None and config.defer_fsdp_grad_sync,
        )
