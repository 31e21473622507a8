"""Gradient-norm clipping over plain, DTensor (FSDP/TP/EP) and pipeline-split gradients.

Gradients are grouped by the device mesh they live on (dense and MoE meshes cannot be stacked
together); each group's norm is a DTensor reduction made full, the squares are summed, and with
pipeline parallelism summed again over the pp group, since each stage holds different parameters.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_grad_norm(
    params: list[torch.nn.Parameter], *, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global L2 norm of all gradients of the model (every rank gets the same value)."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else "local"
        groups[key].append(g)
    sq = torch.zeros((), dtype=torch.float32)
    device = None
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        device = norm.device
        sq = sq.to(device) + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    return sq.sqrt() if device is None else sq.sqrt().to(device)


def clip_grad_norm(
    params: list[torch.nn.Parameter],
    *,
    max_norm: float | None,
    pp_group: dist.ProcessGroup | None = None,
    counted_ids: set[int] | None = None,
) -> torch.Tensor:
    """Clip in place to `max_norm` (None: measure only); returns the norm before clipping.

    `counted_ids`: the parameters (by id) that enter the norm, when some are copies of others
    (a tied weight held by two pipeline stages counts once); every parameter is clipped.
    """
    params = [p for p in params if p.grad is not None]
    counted = params if counted_ids is None else [p for p in params if id(p) in counted_ids]
    norm = total_grad_norm(counted, pp_group=pp_group)
    if max_norm is not None and params:
        by_mesh: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
        for p in params:
            by_mesh[id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else "local"].append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(
                group, max_norm, norm.to(group[0].grad.device), foreach=False
            )
    return norm
