"""Experts kept as embedding rows (Doge's single-neuron retrieval experts): lookups fetch from the owner.

The block's own forward looks its routed experts up with ``table(indices)``. After `apply_ep` the
table's weight is a ``Shard(0)`` DTensor (rank r owns rows [r*L, (r+1)*L)), and the lookup sends
each requested index to its owner, which returns the row; in backward the row gradients travel
back to the owner and accumulate into its shard. The result equals the one-process lookup, so the
block's math (router, activation, weighting) runs unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from automodel.moe.dispatch import all_to_all, plan_dispatch, unsort_rows


def fetch_rows(
    indices: torch.Tensor, *, local_weight: torch.Tensor, num_rows: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``weight[indices]`` of a table split Shard(0) over `group` (`local_weight` is this rank's rows)."""
    rank, local = dist.get_rank(group), local_weight.shape[0]
    flat = indices.reshape(-1)
    plan = plan_dispatch(flat.unsqueeze(-1), num_experts=num_rows, group=group)
    wanted = flat.index_select(0, plan.order)  # sorted by row, hence by owner
    received = torch.empty(plan.num_received, dtype=wanted.dtype, device=wanted.device)
    dist.all_to_all_single(received, wanted, plan.recv_splits, plan.send_splits, group=group)
    rows = F.embedding(received - rank * local, local_weight)
    back = all_to_all(rows, out_splits=plan.send_splits, in_splits=plan.recv_splits, group=group)
    return unsort_rows(back, plan).reshape(*indices.shape, local_weight.shape[-1])


class ExpertParallelEmbedding(nn.Module):
    """Mixin placed in front of ``nn.Embedding``: the same lookup, rows fetched from their owner ranks."""

    _ep_mesh: DeviceMesh
    weight: torch.Tensor  # nn.Embedding's, which follows this mixin

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Embedding's name
        weight = self.weight
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return fetch_rows(
            input, local_weight=local, num_rows=weight.shape[0], group=self._ep_mesh.get_group()
        )
