"""`parallelize_experts`: expert parallelism for MoE models, and the expert units FSDP2 shards.

automodel.moe splits the experts over ``ep`` and dispatches tokens to them; it does no FSDP2 and
no activation checkpointing. The FSDP2 strategy (automodel.fsdp2, composed by automodel.recipes)
shards dense and MoE models alike: it takes the `ExpertShardUnit` list as data ("these modules
are units of their own over this mesh") and replays the routers' decisions under checkpointing
(``MoEParallelizerConfig.ignore_router_for_ac``).

Gradient scale: a dense gradient is the sum over the dp_cp ranks' losses, divided by
``gradient_divide_factor`` (torch's default: the dp_cp size). An expert's gradient already holds
the contributions of its whole ep group (the all-to-all backward brought them), so its FSDP
reduction over ``ep_shard`` must divide by the same total factor, not by ``ep_shard`` alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from automodel.mesh import MeshContext, ResolvedLayout
from automodel.moe.expert_parallel import apply_ep
from automodel.moe.model_inspect import check_expert_parallel_support


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


@dataclass(frozen=True)
class ExpertShardUnit:
    """One expert-parallel experts module, to be an FSDP2 unit of its own before its block's.

    mesh: the ranks holding the same experts (``ep_shard``); the parameters are already DTensors
        ``Shard(0)`` over ``ep`` and FSDP2 adds this dimension.
    shard_placement_fn: FSDP's dim per parameter: 0, or 1 where the local rows are fewer than
        the ep_shard ranks (dim 0 too short to shard).
    gradient_divide_factor: the dense data-parallel divisor (see the module docstring).
    """

    name: str
    module: nn.Module
    mesh: DeviceMesh
    shard_placement_fn: Callable[[nn.Parameter], Shard]
    gradient_divide_factor: float


def _expert_placement(ep_shard: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP's dim for one expert parameter: 0 unless its local rows over ep are fewer than the
    ep_shard ranks (then 1, where it has one)."""

    def placement(param: nn.Parameter) -> Shard:
        rows = param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0]
        return Shard(1 if rows < ep_shard and param.ndim > 1 else 0)

    return placement


def parallelize_experts(
    model: nn.Module,
    *,
    mesh: MeshContext,
    gradient_divide_factor: float | None = None,
    pipeline_stage: bool = False,
) -> list[ExpertShardUnit]:
    """Make the experts of `model` expert parallel over ``ep`` in place; returns the expert units
    FSDP2 must shard over ``ep_shard`` (automodel.fsdp2's ``SubmoduleSharding``).

    ep_size must be > 1. Every rank must hold the same full weights (same seed, or meta tensors
    materialized afterwards). `gradient_divide_factor` is the one the dense units use (None:
    torch's average over the dp*cp ranks; 1.0: pure sum). `pipeline_stage`: `model` is one stage
    of a model whose experts were checked whole; it may hold dense layers only (DeepSeek-V3's
    first layers), then nothing is split and the list is empty.
    """
    if not mesh.ep_enabled:
        raise ValueError(f"parallelize_experts needs ep_size > 1, got ep_size={mesh.layout.ep}")
    if gradient_divide_factor is not None and not gradient_divide_factor > 0:
        raise ValueError(f"gradient_divide_factor must be > 0 or None, got {gradient_divide_factor!r}")
    # the same support rule as the pre-launch checks (refuses what EP cannot split)
    blocks = check_expert_parallel_support(model, allow_dense=pipeline_stage)
    if not blocks:
        if not pipeline_stage:
            validate_moe_layout(layout=mesh.layout, num_experts=[])
        return []
    validate_moe_layout(layout=mesh.layout, num_experts=[b.num_experts for b in blocks])
    expert_mesh = mesh.get_mesh("ep_shard")
    factor = float(mesh.layout.dp_cp) if gradient_divide_factor is None else gradient_divide_factor
    return [
        ExpertShardUnit(
            name=block.experts_name,
            module=block.experts,
            mesh=expert_mesh,
            shard_placement_fn=_expert_placement(expert_mesh.size()),
            gradient_divide_factor=factor,
        )
        for block in apply_ep(model, ep_mesh=mesh.get_mesh("ep"))
    ]
