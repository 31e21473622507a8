"""Gradient-norm clipping over plain, DTensor (FSDP/TP/EP) and pipeline-split gradients.

The sum of squares is accumulated in float64 (torch's multi-tensor norm with a float64
accumulator, one kernel per group of gradients): torch's float32 norm of one large
CPU tensor drifts (1e8 standard normals: 9,889.6 instead of 10,000, measured), and a sharded
layout sums other partial sums than one process does, so a float32 norm differs between layouts
by rounding alone. Each rank sums the squares of its local shards; the sums are then added over
the mesh dimensions a gradient is split over (every one it is not replicated on), and over
`norm_group`, the ranks that hold different plain parameters (the pipeline's stages: the mesh
role `MeshRoles.norm_axes`).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from automodel.recipes.torch_internals import foreach_norms


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Float64 sum of squares of plain tensors: each tensor's norm accumulated in float64 by one
    multi-tensor kernel (no float64 copy of the data), then the squares summed in float64."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    norms = foreach_norms([t.detach() for t in tensors], torch.float64)
    return torch.stack(norms).square().sum()


def total_grad_norm(
    params: list[torch.nn.Parameter], *, norm_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The global L2 norm of all gradients of the model (every rank gets the same value, float32)."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else "local"
        groups[key].append(g)
    sq = None
    for grads in groups.values():
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        part = _sum_of_squares(local)
        if isinstance(grads[0], DTensor):
            for dim, placement in enumerate(grads[0].placements):
                if placement.is_partial():
                    raise ValueError(
                        f"gradient with a pending reduction ({grads[0].placements}) cannot be normed"
                    )
                if not placement.is_replicate():  # Shard, and FSDP-over-TP's _StridedShard
                    dist.all_reduce(part, group=grads[0].device_mesh.get_group(dim))
        sq = part if sq is None else sq + part.to(sq.device)
    if sq is None:
        sq = torch.zeros((), dtype=torch.float64)
    if norm_group is not None:
        dist.all_reduce(sq, group=norm_group)
    return sq.sqrt().float()


def clip_grad_norm(
    params: list[torch.nn.Parameter],
    *,
    max_norm: float | None,
    norm_group: dist.ProcessGroup | None = None,
    counted_ids: set[int] | None = None,
) -> torch.Tensor:
    """Clip in place to `max_norm` (None: measure only); returns the norm before clipping.

    `counted_ids`: the parameters (by id) that enter the norm, when some are copies of others
    (a tied weight held by two pipeline stages counts once); every parameter is clipped.
    """
    params = [p for p in params if p.grad is not None]
    counted = params if counted_ids is None else [p for p in params if id(p) in counted_ids]
    norm = total_grad_norm(counted, norm_group=norm_group)
    if max_norm is not None and params:
        by_mesh: dict[object, list[torch.nn.Parameter]] = defaultdict(list)
        for p in params:
            by_mesh[id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else "local"].append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(
                group, max_norm, norm.to(group[0].grad.device), foreach=False
            )
    return norm
