"""Blockwise exact attention with log-sum-exp merging (the math under ring attention).

Shapes: queries ``[B, Hkv, G, Sq, D]`` (G query heads per K/V head), keys/values
``[B, Hkv, 1, Sk, D]``, masks ``[Sq, Sk]`` (True = may attend), log-sum-exp ``[B, Hkv, G, Sq]``.
Everything is computed in fp32, so bf16 inputs lose no accuracy in the merge.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def block_mask(
    q_index: torch.Tensor,
    k_index: torch.Tensor,
    *,
    causal: bool,
    q_doc: torch.Tensor | None,
    k_doc: torch.Tensor | None,
) -> torch.Tensor | None:
    """Which (query, key) pairs may attend; None means all of them (no mask needed)."""
    mask = None
    if causal:
        mask = k_index.unsqueeze(0) <= q_index.unsqueeze(1)
    if q_doc is not None:
        same_doc = q_doc.unsqueeze(1) == k_doc.unsqueeze(0)
        mask = same_doc if mask is None else mask & same_doc
    if mask is not None and bool(mask.all()):
        return None
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, NEG_INF)
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # Rows that see no key have lse = -inf; use 0 there so exp(-inf - 0) = 0 instead of NaN.
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query block over one key block: (output, log-sum-exp)."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v), lse


def merge(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmax-attention results over disjoint key sets."""
    new_lse = torch.logaddexp(lse, block_lse)
    ref = _finite(new_lse)
    w_old = torch.exp(lse - ref).unsqueeze(-1)
    w_new = torch.exp(block_lse - ref).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the final lse and ``delta = rowsum(grad_out * out)``."""
    s = _scores(q, k, mask, scale)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    grad_v = torch.matmul(p.transpose(-1, -2), grad_out).sum(dim=2, keepdim=True)
    grad_p = torch.matmul(grad_out, v.transpose(-1, -2))
    grad_s = p * (grad_p - delta.unsqueeze(-1))
    grad_q = torch.matmul(grad_s, k) * scale
    grad_k = torch.matmul(grad_s.transpose(-1, -2), q).sum(dim=2, keepdim=True) * scale
    return grad_q, grad_k, grad_v
