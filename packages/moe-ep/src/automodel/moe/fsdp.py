"""`apply_fsdp` for MoE models: experts over ``ep_shard``, everything else over the dense dp mesh.

Expert parameters are already DTensors ``Shard(0)`` over ``ep``; FSDP2 adds a second dimension
over ``ep_shard`` (the ranks holding the same experts). When ``ep_shard`` is larger than a
parameter's local rows (the local experts, or their blocks of rows for flat [E*k, ...] rows), dim 0
is too short to shard, so FSDP shards dim 1 instead. One FSDP unit per experts module holds its
expert parameters wherever they sit (DBRX's are in its ``mlp`` child).

Gradient scale: a dense gradient is the sum over the dp_cp ranks' losses, divided by
``gradient_divide_factor`` (torch's default: the dp_cp size). An expert's gradient already holds
the contributions of its whole ep group (the all-to-all backward brought them), so its FSDP
reduction over ``ep_shard`` must divide by the same total factor, not by ``ep_shard`` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from automodel.mesh.reduction import reduce_unused_parameters, set_unit_gradient_divide_factor


def _shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None,
    divide_factor: float | None,
    shard_placement_fn: object | None = None,
) -> None:
    kwargs: dict[str, Any] = {"mp_policy": mp_policy} if mp_policy is not None else {}
    if shard_placement_fn is not None:
        kwargs["shard_placement_fn"] = shard_placement_fn
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, **kwargs)
    # an expert no token of this rank reached has no gradient: reduce it as zeros, not skip it
    reduce_unused_parameters(module)
    if divide_factor is not None:
        set_unit_gradient_divide_factor(module, factor=divide_factor)


def _expert_placement(ep_shard: int) -> Callable[[nn.Parameter], Shard]:
    """FSDP's dim for one expert parameter: 0 unless its local rows over ep are fewer than the
    ep_shard ranks (then 1, where it has one)."""

    def placement(param: nn.Parameter) -> Shard:
        rows = param.to_local().shape[0] if isinstance(param, DTensor) else param.shape[0]
        return Shard(1 if rows < ep_shard and param.ndim > 1 else 0)

    return placement


def _is_managed(name: str, units: set[str]) -> bool:
    return any(unit == "" or name == unit or name.startswith(unit + ".") for unit in units)


def apply_fsdp(
    model: nn.Module,
    *,
    dense_mesh: DeviceMesh,
    layers: Iterable[tuple[str, nn.Module]],
    experts: Iterable[tuple[str, nn.Module]] = (),
    expert_mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    lm_head_precision: torch.dtype | None = None,
    wrap_outer_model: bool = True,
    gradient_divide_factor: float | None = None,
) -> None:
    """fully_shard expert modules, then transformer blocks, then the head and the rest of the model.

    `experts` are expert-parallel experts modules (DTensor parameters over ep) sharded over
    `expert_mesh`; `layers` are (FQN, block) pairs sharded over `dense_mesh` (1-D for FSDP,
    2-D ``(dp_replicate, dp_shard_cp)`` for HSDP).
    """
    experts = list(experts)
    units: set[str] = set()
    if experts:
        assert expert_mesh is not None, "expert-parallel experts need an ep_shard mesh"
        dense_world = dense_mesh.size()
        expert_factor = gradient_divide_factor if gradient_divide_factor is not None else float(dense_world)
        for name, module in experts:
            _shard(
                module,
                mesh=expert_mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy,
                divide_factor=expert_factor,
                shard_placement_fn=_expert_placement(expert_mesh.size()),
            )
            units.add(name)
    shard = dict(
        mesh=dense_mesh, reshard_after_forward=reshard_after_forward, divide_factor=gradient_divide_factor
    )
    for name, layer in layers:
        _shard(layer, mp_policy=mp_policy, **shard)
        units.add(name)
    lm_head = getattr(model, "lm_head", None)  # None on pipeline stages before the last
    if lm_head_precision is not None and isinstance(lm_head, nn.Module):
        head_policy = MixedPrecisionPolicy(
            param_dtype=lm_head_precision, reduce_dtype=torch.float32, output_dtype=lm_head_precision
        )
        _shard(lm_head, mp_policy=head_policy, **shard)
        units.add("lm_head")
    if wrap_outer_model:
        _shard(model, mp_policy=mp_policy, **shard)
        return
    # No root unit: every module that still owns unmanaged parameters becomes its own unit.
    for name, module in list(model.named_modules()):
        own = [p for p in module.parameters(recurse=False)]
        if own and not _is_managed(name, units) and not isinstance(module, FSDPModule):
            _shard(module, mp_policy=mp_policy, **shard)
            units.add(name)
