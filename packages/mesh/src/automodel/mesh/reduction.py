"""How an FSDP2 unit reduces gradients across data-parallel ranks, on every backend.

A custom gradient divide factor becomes NCCL's PREMUL_SUM; backends without it (gloo) must reduce
with a plain SUM and scale afterwards, or the reduction fails. Every package that shards with FSDP2
(automodel.fsdp2, automodel.moe) sets the factor through this one function, and makes unused
parameters join the reduction through `reduce_unused_parameters`.
"""

from __future__ import annotations

from typing import cast

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from automodel.mesh.torch_internals import reduce_unused_gradients_as_zeros


def set_unit_gradient_divide_factor(unit: FSDPModule, *, factor: float) -> None:
    """Divide `unit`'s reduced gradients by `factor` instead of its data-parallel size (1.0 = sum)."""
    if factor <= 0:
        raise ValueError(f"gradient divide factor must be > 0, got {factor}")
    unit.set_gradient_divide_factor(factor)
    if _reduces_outside_nccl(unit) and hasattr(unit, "set_force_sum_reduction_for_comms"):
        unit.set_force_sum_reduction_for_comms(True)


def _reduces_outside_nccl(unit: FSDPModule) -> bool:
    """Whether a group of the mesh `unit`'s parameters are sharded over is not NCCL (read off the
    parameters, which FSDP2 makes DTensors on that mesh; the default group when it has none)."""
    params = cast(nn.Module, unit).parameters()
    meshes = {id(p.device_mesh): p.device_mesh for p in params if isinstance(p, DTensor)}
    if not meshes:
        return dist.get_backend() != "nccl"
    return any(dist.get_backend(g) != "nccl" for mesh in meshes.values() for g in mesh.get_all_groups())


def reduce_unused_parameters(unit: FSDPModule) -> None:
    """Make a trainable parameter of `unit` that got no gradient on this rank join the gradient
    reduction as zeros (torch 2.13's ``set_reduce_scatter_unused_params``; on earlier torch through
    `torch_internals.reduce_unused_gradients_as_zeros`).

    FSDP2 reduce-scatters only the parameters with a gradient, so ranks whose micro-batches route
    around a parameter (LongCat-Flash's zero-computation experts: no token of a rank reached a real
    expert) issue reductions of different sizes: gloo aborts, NCCL hangs or mixes the buffers. A
    parameter no rank used then gets a zero gradient instead of none (optimizers with weight decay
    or momentum step it). Frozen parameters are never reduced.
    """
    setter = getattr(unit, "set_reduce_scatter_unused_params", None)
    if setter is not None:
        setter(True, recurse=False)
    elif isinstance(unit, FSDPModule):  # torch < 2.13 (a grouped fully_shard's list: untouched, as on 2.13)
        reduce_unused_gradients_as_zeros(unit)
