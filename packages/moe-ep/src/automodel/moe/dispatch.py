"""Token dispatch and combine for expert parallelism: two uneven all-to-alls with autograd.

Rank r of an ep group owns the experts ``[r*L, (r+1)*L)`` (L = E/ep). Every rank routes its own
tokens (router top-k runs everywhere), sorts its (token, slot) pairs by expert, which also sorts
them by owner, and sends each owner its share. The owner regroups what it received by local
expert, runs them, and the reverse all-to-all brings results back, where they are weighted by
the router scores and summed per token. Backward runs the same exchanges in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from automodel.moe.load import record_dispatch
from automodel.moe.torch_internals import all_to_all_single_autograd


@dataclass(frozen=True)
class DispatchPlan:
    """Where every routed (token, slot) pair of this rank goes, and what this rank receives."""

    #: [T*K] slot positions sorted by expert (stable): sorted slot i is flat slot ``order[i]``.
    order: torch.Tensor
    #: [T*K] token index of every sorted slot (``order // K``).
    token_of_slot: torch.Tensor
    #: tokens sent to / received from each ep rank.
    send_splits: list[int]
    recv_splits: list[int]
    #: [ep, L] tokens received from source rank s for local expert e.
    recv_counts: torch.Tensor
    #: tokens per local expert after regrouping (sum over sources).
    local_counts: list[int]
    #: permutation of the received buffer from (source, expert) to (expert, source) order, and back.
    regroup: torch.Tensor
    ungroup: torch.Tensor

    @property
    def num_received(self) -> int:
        return sum(self.recv_splits)


def plan_dispatch(
    top_k_index: torch.Tensor, *, num_experts: int, group: dist.ProcessGroup | None
) -> DispatchPlan:
    """Exchange per-expert token counts within the ep group and derive every split and permutation."""
    ep = dist.get_world_size(group)
    assert num_experts % ep == 0, (num_experts, ep)
    local = num_experts // ep
    top_k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    recv_counts = recv_counts.view(ep, local)
    send_splits = counts.view(ep, local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    chunk = torch.repeat_interleave(torch.arange(ep * local, device=flat.device), recv_counts.reshape(-1))
    source, expert = chunk // local, chunk % local
    regroup = torch.argsort(expert * ep + source, stable=True)
    record_dispatch(sent=sum(send_splits), received=sum(recv_splits))
    return DispatchPlan(
        order=order,
        token_of_slot=order // top_k,
        send_splits=send_splits,
        recv_splits=recv_splits,
        recv_counts=recv_counts,
        local_counts=recv_counts.sum(0).tolist(),
        regroup=regroup,
        ungroup=torch.argsort(regroup),
    )


def all_to_all(
    x: torch.Tensor, *, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Uneven all-to-all of rows of `x` whose backward is the reverse all-to-all."""
    group = group if group is not None else dist.group.WORLD
    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


def dispatch_tokens(x: torch.Tensor, plan: DispatchPlan, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send routed copies of `x` [T, H] to their experts' owners; returns [received, H] grouped by local expert."""
    sent = x.index_select(0, plan.token_of_slot)
    received = all_to_all(sent, out_splits=plan.recv_splits, in_splits=plan.send_splits, group=group)
    return received.index_select(0, plan.regroup)


def return_tokens(y: torch.Tensor, plan: DispatchPlan, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Send expert outputs `y` (grouped by local expert) back to their senders; rows in sorted-slot order."""
    return all_to_all(
        y.index_select(0, plan.ungroup), out_splits=plan.send_splits, in_splits=plan.recv_splits, group=group
    )


def unsort_rows(rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Rows in sorted-slot order back to the flat slot order the routing was given in."""
    return rows.index_select(0, torch.argsort(plan.order))


def combine_tokens(
    y: torch.Tensor,
    plan: DispatchPlan,
    *,
    top_k_weights: torch.Tensor,
    num_tokens: int,
    out_dtype: torch.dtype,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Return expert outputs to their tokens' ranks and sum them per token, weighted by the router."""
    back = return_tokens(y, plan, group=group)
    weights = top_k_weights.reshape(-1).index_select(0, plan.order)
    weighted = (back * weights.unsqueeze(-1)).to(out_dtype)
    out = torch.zeros((num_tokens, y.shape[-1]), dtype=out_dtype, device=y.device)
    return out.index_add(0, plan.token_of_slot, weighted)
