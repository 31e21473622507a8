"""Which global tokens a CP rank holds: head-tail load balancing over ``2 * cp`` chunks.

With causal attention the tokens late in the sequence attend to many more keys than the early
ones; giving rank r the chunks r and ``2*cp-1-r`` makes every rank's share of the work equal.
The same layout is used by torch's ``context_parallel`` (its head-tail load balancer) and by
Transformer Engine, so batches sharded here can feed any of the three backends.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def load_balanced_indices(
    seq_len: int, *, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions held by `cp_rank`: chunk ``cp_rank`` then chunk ``2*cp_size-1-cp_rank``."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"seq_len={seq_len} must be a multiple of 2*cp_size={2 * cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, cp_size={cp_size})")
    chunk = seq_len // (2 * cp_size)
    head = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    tail_start = (2 * cp_size - 1 - cp_rank) * chunk
    tail = torch.arange(tail_start, tail_start + chunk, device=device)
    return torch.cat([head, tail])


def contiguous_indices(
    seq_len: int, *, cp_size: int, cp_rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """Global positions held by `cp_rank` without load balancing (one contiguous slice)."""
    if seq_len % cp_size != 0:
        raise ValueError(f"seq_len={seq_len} must be a multiple of cp_size={cp_size}")
    local = seq_len // cp_size
    return torch.arange(cp_rank * local, (cp_rank + 1) * local, device=device)


def shard_sequence(tensor: torch.Tensor, *, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's load-balanced shard of `tensor` along `dim` (the length must divide by 2*cp)."""
    index = load_balanced_indices(tensor.shape[dim], cp_size=cp_size, cp_rank=cp_rank, device=tensor.device)
    return tensor.index_select(dim, index)


def unshard_sequence(local: torch.Tensor, *, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Inverse of `shard_sequence` across `group`: every rank gets the full tensor in global order."""
    cp_size = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    seq_len = local.shape[dim] * cp_size
    order = torch.cat(
        [
            load_balanced_indices(seq_len, cp_size=cp_size, cp_rank=r, device=local.device)
            for r in range(cp_size)
        ]
    )
    gathered = torch.cat(parts, dim=dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len, device=local.device)
    return gathered.index_select(dim, inverse)
