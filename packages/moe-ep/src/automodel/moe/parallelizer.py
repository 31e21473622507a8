"""`parallelize_model`: the entry point recipes call for MoE models (EP -> AC -> FSDP2)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from automodel.mesh import MeshContext, ResolvedLayout
from automodel.mesh.model_parts import named_decoder_layers
from automodel.moe.checkpointing import apply_ac
from automodel.moe.config import MoEParallelizerConfig
from automodel.moe.expert_parallel import apply_ep
from automodel.moe.fsdp import apply_fsdp
from automodel.moe.model_inspect import check_expert_parallel_support, find_moe_blocks


def validate_moe_layout(*, layout: ResolvedLayout, num_experts: list[int]) -> None:
    """Check that `layout`'s ep size fits a model whose MoE blocks have `num_experts` experts each.

    An empty `num_experts` means a dense model.
    """
    ep = layout.ep
    if ep == 1:
        return
    if not num_experts:
        raise ValueError(
            f"ep_size={ep} but the model has no MoE block with stacked experts (a dense model); "
            "use ep_size=1 for dense models"
        )
    if layout.dp_cp % ep != 0:
        raise ValueError(
            f"ep_size={ep} must divide dp_size*cp_size = {layout.dp_cp} (dp_size={layout.dp}, cp_size={layout.cp})"
        )
    for count in sorted(set(num_experts)):
        if count % ep != 0:
            raise ValueError(
                f"ep_size={ep} must divide the number of experts, but the model has {count} experts"
            )


def dense_fsdp_mesh(mesh: MeshContext) -> DeviceMesh | None:
    """The mesh non-expert parameters are sharded over: dp_shard_cp, or (dp_replicate, dp_shard_cp) for HSDP."""
    layout = mesh.layout
    if layout.dp_cp == 1:
        return None
    if layout.dp_replicate_enabled:
        return mesh.device_mesh[("dp_replicate", "dp_shard_cp")]
    return mesh.get_mesh("dp_shard_cp")


def parallelize_model(
    model: nn.Module,
    *,
    mesh: MeshContext,
    config: MoEParallelizerConfig | None = None,
    activation_checkpointing: bool = False,
    mp_policy: object | None = None,
    gradient_divide_factor: float | None = None,
    pipeline_stage: bool = False,
) -> nn.Module:
    """Apply expert parallelism, activation checkpointing and FSDP2 to a Hugging Face MoE model, in place.

    Order: EP (experts ``Shard(0)`` over ``ep``) -> activation checkpointing per block
    -> FSDP2 (experts over ``ep_shard``, the rest over the dense dp mesh). A dense model is
    returned untouched when ep_size is 1 (shard it with automodel.fsdp2), and rejected otherwise.
    `mp_policy` overrides ``config.mp_policy``; `gradient_divide_factor` scales every data-parallel
    gradient reduction (None: average over dp*cp ranks; 1.0: pure sum). Every rank must hold the
    same full weights (same seed, or meta tensors materialized afterwards).

    `pipeline_stage`: `model` is one pipeline stage of a model whose experts were checked whole;
    it may hold dense layers only (DeepSeek-V3's first layers are dense), which are then given
    activation checkpointing and FSDP2 like any stage, with nothing to split over ep.
    """
    config = config if config is not None else MoEParallelizerConfig()
    if not isinstance(config, MoEParallelizerConfig):
        raise ValueError(f"config must be a MoEParallelizerConfig, got {type(config).__name__}")
    if gradient_divide_factor is not None and not gradient_divide_factor > 0:
        raise ValueError(f"gradient_divide_factor must be > 0 or None, got {gradient_divide_factor!r}")
    if mp_policy is not None:
        config = MoEParallelizerConfig(**{**config.__dict__, "mp_policy": mp_policy})
    # ep > 1: the same support rule as the pre-launch checks (refuses what EP cannot split)
    if mesh.ep_enabled:
        blocks = check_expert_parallel_support(model, allow_dense=pipeline_stage)
    else:
        blocks = find_moe_blocks(model)
    if not blocks and not (mesh.ep_enabled and pipeline_stage):
        validate_moe_layout(layout=mesh.layout, num_experts=[])
        return model
    if blocks:
        validate_moe_layout(layout=mesh.layout, num_experts=[b.num_experts for b in blocks])
    experts = []
    if mesh.ep_enabled and blocks:
        experts = [(b.experts_name, b.experts) for b in apply_ep(model, ep_mesh=mesh.get_mesh("ep"))]
    layers = named_decoder_layers(model)
    if activation_checkpointing:
        if not layers:
            raise ValueError(
                "activation_checkpointing=True but the model has no `layers` container of blocks"
            )
        apply_ac([layer for _, layer in layers], save_router_decisions=config.ignore_router_for_ac)
    dense_mesh = dense_fsdp_mesh(mesh)
    if dense_mesh is not None:
        apply_fsdp(
            model,
            dense_mesh=dense_mesh,
            layers=layers,
            experts=experts,
            expert_mesh=mesh.get_mesh("ep_shard") if experts else None,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=config.mp_policy,
            lm_head_precision=config.lm_head_precision,
            wrap_outer_model=config.wrap_outer_model,
            gradient_divide_factor=gradient_divide_factor,
        )
    return model
