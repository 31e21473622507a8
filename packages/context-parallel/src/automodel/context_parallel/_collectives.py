"""Tensor collectives over a process group, with the non-deprecated names where this torch has them.

torch 2.13 renamed ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` to ``*_single``; the
package must also run on torch 2.11, which only has the old names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_stacked(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Gather `tensor` from every rank of `group` into a new leading dim (rank order)."""
    world = dist.get_world_size(group)
    # Flat buffers: gloo checks the output is exactly world * the input's shape along dim 0.
    out = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    _all_gather_single(out, tensor.contiguous().reshape(-1), group=group)
    return out.view(world, *tensor.shape)


def reduce_scatter_stacked(stacked: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum ``stacked[j]`` over all ranks and hand the result for index j to rank j."""
    out = torch.empty(stacked[0].numel(), dtype=stacked.dtype, device=stacked.device)
    _reduce_scatter_single(out, stacked.contiguous().reshape(-1), group=group)
    return out.view(stacked.shape[1:])


def ring_exchange(send: torch.Tensor, group: ProcessGroup, *, tag: int = 0) -> tuple[torch.Tensor, list]:
    """Start sending `send` to the next rank of the ring and receiving from the previous one.

    Returns the receive buffer and the requests; wait on them before reading the buffer.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % world)
    prv = dist.get_global_rank(group, (rank - 1) % world)
    recv = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, nxt, group, tag), dist.P2POp(dist.irecv, recv, prv, group, tag)]
    return recv, dist.batch_isend_irecv(ops)


def wait_all(requests: list) -> None:
    for req in requests:
        req.wait()
