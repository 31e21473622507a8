"""Ring attention: exact attention over a sequence sharded across a CP group, on any device.

Every rank holds the queries, keys and values of its own tokens (any layout; the caller says
which global positions they are). K/V blocks travel either by one all-gather ("allgather") or
around a ring of point-to-point sends that overlap with compute ("p2p"); each query block is
merged with every K/V block through its log-sum-exp, so the result equals full attention.
The backward pass recomputes scores block by block (flash-attention style) and returns the
K/V gradients to their owners by reduce-scatter ("allgather") or by letting them ride the
ring back home ("p2p"). Causal masking and document boundaries (packed sequences) are
expressed through global token positions and document ids, so load balancing is free.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from automodel.context_parallel import _blockwise as bw
from automodel.context_parallel._collectives import (
    all_gather_stacked,
    reduce_scatter_stacked,
    ring_exchange,
    wait_all,
)

KVRotation = Literal["allgather", "p2p"]
KV_ROTATIONS: tuple[str, ...] = ("allgather", "p2p")


class _Layout:
    """Global positions and document ids of every rank's tokens (small; gathered once)."""

    def __init__(
        self, q_index: torch.Tensor, doc_ids: torch.Tensor | None, group: ProcessGroup, causal: bool
    ):
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.causal = causal
        self.q_index = q_index
        self.q_doc = doc_ids
        self.all_index = all_gather_stacked(q_index, group)
        self.all_doc = None if doc_ids is None else all_gather_stacked(doc_ids, group)

    def mask(self, source: int) -> tuple[bool, torch.Tensor | None]:
        """(any pair attends, mask or None) for our queries against `source`'s keys."""
        k_doc = None if self.all_doc is None else self.all_doc[source]
        m = bw.block_mask(
            self.q_index, self.all_index[source], causal=self.causal, q_doc=self.q_doc, k_doc=k_doc
        )
        return (m is None or bool(m.any())), m


def _sources(rank: int, world: int) -> list[int]:
    # Step i works on the K/V block that started on rank (rank - i) mod world.
    return [(rank - i) % world for i in range(world)]


def _forward(q, k, v, layout: _Layout, group, scale: float, rotation: str):
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], bw.NEG_INF, dtype=q.dtype, device=q.device)
    if rotation == "allgather":
        kv_all = all_gather_stacked(torch.stack([k, v]), group)
        for src in range(layout.world):
            attend, mask = layout.mask(src)
            if attend:
                o, s = bw.block_forward(q, kv_all[src, 0], kv_all[src, 1], mask, scale)
                out, lse = bw.merge(out, lse, o, s)
        return out, lse
    kv = torch.stack([k, v])
    for step, src in enumerate(_sources(layout.rank, layout.world)):
        pending = None
        if step + 1 < layout.world:
            pending = ring_exchange(kv, group)
        attend, mask = layout.mask(src)
        if attend:
            o, s = bw.block_forward(q, kv[0], kv[1], mask, scale)
            out, lse = bw.merge(out, lse, o, s)
        if pending is not None:
            kv, reqs = pending
            wait_all(reqs)
    return out, lse


def _backward(q, k, v, out, lse, grad_out, layout: _Layout, group, scale: float, rotation: str):
    delta = (grad_out * out).sum(dim=-1)
    grad_q = torch.zeros_like(q)
    if rotation == "allgather":
        kv_all = all_gather_stacked(torch.stack([k, v]), group)
        grad_kv_all = torch.zeros_like(kv_all)
        for src in range(layout.world):
            attend, mask = layout.mask(src)
            if attend:
                gq, gk, gv = bw.block_backward(
                    q, kv_all[src, 0], kv_all[src, 1], mask, scale, grad_out, lse, delta
                )
                grad_q += gq
                grad_kv_all[src, 0] += gk
                grad_kv_all[src, 1] += gv
        grad_kv = reduce_scatter_stacked(grad_kv_all, group)
        return grad_q, grad_kv[0], grad_kv[1]
    kv = torch.stack([k, v])
    grad_kv = torch.zeros_like(kv)
    for step, src in enumerate(_sources(layout.rank, layout.world)):
        pending = None
        if step + 1 < layout.world:
            pending = ring_exchange(kv, group)
        attend, mask = layout.mask(src)
        if attend:
            gq, gk, gv = bw.block_backward(q, kv[0], kv[1], mask, scale, grad_out, lse, delta)
            grad_q += gq
            grad_kv[0] += gk
            grad_kv[1] += gv
        # The K/V gradient accumulator travels with its block and arrives home after the last hop.
        grad_kv, reqs = ring_exchange(grad_kv, group, tag=1)
        wait_all(reqs)
        if pending is not None:
            kv, reqs = pending
            wait_all(reqs)
    return grad_q, grad_kv[0], grad_kv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout: _Layout, group: ProcessGroup, scale: float, rotation: str):
        out, lse = _forward(q, k, v, layout, group, scale, rotation)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.scale, ctx.rotation = layout, group, scale, rotation
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _backward(
            q, k, v, out, lse, grad_out.contiguous(), ctx.layout, ctx.group, ctx.scale, ctx.rotation
        )
        return (*grads, None, None, None, None)


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cp_group: ProcessGroup,
    token_index: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    kv_rotation: KVRotation = "allgather",
) -> torch.Tensor:
    """Exact attention of this rank's queries over the keys/values of the whole CP group.

    Args:
        query: ``[B, Hq, S_local, D]``; key/value: ``[B, Hkv, S_local, D]`` with ``Hq % Hkv == 0``
            (grouped-query attention without repeating K/V).
        cp_group: the context-parallel process group (every rank passes the same S_local).
        token_index: ``[S_local]`` global position of each local token (causal order).
        doc_ids: ``[S_local]`` document id of each local token for packed sequences; tokens
            of different documents never attend to each other. None = one document.
        causal: mask keys at later global positions.
        scale: softmax scale, default ``D ** -0.5``.
        kv_rotation: "allgather" (one all-gather of K/V) or "p2p" (ring of sends overlapped
            with compute; K/V memory stays at two blocks).

    Returns:
        ``[B, Hq, S_local, D]`` in the dtype of `query`.
    """
    if kv_rotation not in KV_ROTATIONS:
        raise ValueError(f"kv_rotation must be one of {KV_ROTATIONS}, got {kv_rotation!r}")
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4:
        raise ValueError(
            f"expected query [B,Hq,S,D] and key/value [B,Hkv,S,D], got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    b, hq, s, d = query.shape
    hkv = key.shape[1]
    if hq % hkv != 0 or key.shape[2] != s:
        raise ValueError(f"query heads {hq} must be a multiple of key heads {hkv} and lengths must match")
    if token_index.shape != (s,) or (doc_ids is not None and doc_ids.shape != (s,)):
        raise ValueError(f"token_index and doc_ids must have shape ({s},)")
    scale = d**-0.5 if scale is None else float(scale)
    if dist.get_world_size(cp_group) == 1:
        kv_rotation = "allgather"  # nothing to rotate (and gloo cannot send to itself)
    layout = _Layout(token_index, doc_ids, cp_group, causal)
    # Half precisions accumulate in float32; float64 stays float64 (never a silent downcast).
    compute = torch.promote_types(query.dtype, torch.float32)
    q = query.to(compute).reshape(b, hkv, hq // hkv, s, d)
    k = key.to(compute).unsqueeze(2)
    v = value.to(compute).unsqueeze(2)
    out = _RingAttention.apply(q, k, v, layout, cp_group, scale, kv_rotation)
    return out.reshape(b, hq, s, d).to(query.dtype)
