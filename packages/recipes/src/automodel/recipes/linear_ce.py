"""Cross-entropy of ``hidden @ weight.T`` without the full logits: chunked over tokens, fp32 maths.

A causal LM's head turns ``[tokens, hidden]`` into ``[tokens, vocab]`` logits; at vocab 128256 and
4096 tokens that is 2 GiB in fp32, and the usual path keeps the logits, their fp32 copy and the
log-softmax for backward. Here each chunk of tokens gets its logits, log-sum-exp and gradients
(softmax minus one-hot) at once, and only the gradients of the hidden states and the head
(``[tokens, hidden]`` and ``[vocab, hidden]``) live until backward, which scales them by the
incoming gradient. The matmuls run in the inputs' dtype; softmax, log-sum-exp and the head's
gradient accumulate in fp32.

A head sharded over the vocabulary (tensor parallelism: a DTensor weight with ``Shard(0)`` on a
1-D mesh) computes its logit columns only; the log-sum-exp and the target logit are reduced over
the mesh per chunk, and the hidden-state gradient once at the end.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

#: fp32 logit elements per chunk on CPU (128 MiB) and on accelerators (512 MiB).
CHUNK_ELEMENTS = {"cpu": 1 << 25, "accelerator": 1 << 27}


def default_chunk_tokens(*, vocab: int, device: torch.device) -> int:
    """Tokens per chunk: a power of two keeping one chunk's fp32 logits within `CHUNK_ELEMENTS`."""
    budget = CHUNK_ELEMENTS["cpu" if device.type == "cpu" else "accelerator"]
    return max(16, 1 << int(math.log2(max(1, budget // max(1, vocab)))))


class _LinearCrossEntropy(torch.autograd.Function):
    """Sum of token CE of ``softcap(scale * (h @ w.T + b))``; gradients are computed in forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        options: dict,
    ) -> torch.Tensor:
        loss, grads = _chunked_pass(hidden, weight, bias, labels, **options)
        ctx.grads = list(grads)
        ctx.options = options
        ctx.save_for_backward(hidden, weight, bias, labels)  # inputs: no extra memory
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        grads = ctx.grads
        ctx.grads = None
        if grads is None:
            # a second backward through a retained graph (a zero-bubble pipeline schedule: input
            # gradients first, weight gradients later): the gradients are computed again
            _, grads = _chunked_pass(*ctx.saved_tensors, **ctx.options)
        # scaled in place and handed over: autograd takes them as the .grad without a copy
        scaled = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads]
        return scaled[0], scaled[1], scaled[2], None, None


def _chunked_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    ignore_index: int,
    chunk_tokens: int,
    vocab_offset: int,
    group: dist.ProcessGroup | None,
    softcap: float | None,
    scale: float | None,
    want_grads: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The loss (fp32 scalar) and, where `want_grads`, d loss / d (hidden, weight, bias)."""
    n, v_local = hidden.shape[0], weight.shape[0]
    grad_h = (
        torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device) if want_grads[0] else None
    )
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grads[1] else None
    grad_b = (
        torch.zeros(v_local, dtype=torch.float32, device=weight.device)
        if bias is not None and want_grads[2]
        else None
    )
    any_grad = grad_h is not None or grad_w is not None or grad_b is not None
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, n, chunk_tokens):
        h = hidden[start : start + chunk_tokens]
        y = labels[start : start + chunk_tokens]
        z = (h @ weight.T).float()
        if bias is not None:
            z += bias.float()
        if scale is not None:
            z *= scale
        if softcap is not None:
            z = torch.tanh(z / softcap).mul_(softcap)
        valid = y != ignore_index
        local = y - vocab_offset
        owned = valid & (local >= 0) & (local < v_local)
        index = torch.where(owned, local, 0).unsqueeze(1)
        target = torch.where(owned, z.gather(1, index).squeeze(1), 0.0)
        row_max = z.max(dim=1).values
        if group is not None:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        z_shift = (
            z - row_max.unsqueeze(1) if softcap is not None and any_grad else z.sub_(row_max.unsqueeze(1))
        )
        probs = z_shift.exp_()  # exp(z - max), in place
        stats = torch.stack([probs.sum(dim=1), target])
        if group is not None:
            dist.all_reduce(stats, group=group)
        lse = row_max + stats[0].log()
        loss += torch.where(valid, lse - stats[1], 0.0).sum()
        if not any_grad:
            continue
        probs /= stats[0].unsqueeze(1)  # softmax
        probs.scatter_add_(1, index, torch.where(owned, -1.0, 0.0).unsqueeze(1))
        probs *= valid.unsqueeze(1)  # d loss / d z
        if softcap is not None:
            probs *= 1.0 - (z / softcap).square_()  # tanh' (z still holds the capped logits)
        if scale is not None:
            probs *= scale
        grad_z = probs.to(hidden.dtype)
        if grad_h is not None:
            grad_h[start : start + chunk_tokens] = grad_z @ weight
        if grad_w is not None:
            if grad_z.dtype == grad_w.dtype:
                grad_w.addmm_(grad_z.T, h)  # fp32 inputs: no [vocab, hidden] temporary
            else:  # bf16 matmul (tensor cores), accumulated in fp32
                grad_w += grad_z.T @ h
        if grad_b is not None:
            grad_b += probs.sum(dim=0)
    if grad_h is not None and group is not None:
        dist.all_reduce(grad_h, group=group)  # each rank saw its vocabulary columns only
    return loss, (
        None if grad_h is None else grad_h.to(hidden.dtype),
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None or bias is None else grad_b.to(bias.dtype),
    )


def _vocab_shard(weight: torch.Tensor) -> tuple[torch.Tensor, int, dist.ProcessGroup | None]:
    """`(local rows, first vocabulary row held, group to reduce over)` of the head's weight."""
    if not isinstance(weight, DTensor):
        return weight, 0, None
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1 or placements not in ((Shard(0),), (Replicate(),)):
        raise ValueError(
            f"linear cross-entropy takes a head weight sharded over the vocabulary (Shard(0) on a 1-D mesh) "
            f"or replicated; got placements {placements} on mesh {mesh}"
        )
    local = weight.to_local()
    if placements == (Replicate(),) or mesh.size() == 1:
        return local, 0, None
    per_rank = -(-weight.shape[0] // mesh.size())  # torch.chunk's split, as Shard(0) lays rows out
    offset = min(mesh.get_local_rank() * per_rank, weight.shape[0])
    return local, offset, mesh.get_group()


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    chunk_tokens: int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Sum over tokens of ``CE(softcap(scale * (hidden @ weight.T + bias)), labels)`` in fp32.

    `hidden` is ``[..., H]`` (a DTensor is gathered whole first, e.g. a sequence-parallel one),
    `labels` the matching ``[...]`` token ids (`ignore_index` carries no loss), `weight` the head's
    ``[V, H]`` (a vocabulary-sharded DTensor computes its columns only). Equals
    ``F.cross_entropy(logits.float(), labels, reduction="sum")`` with gradients for `hidden`,
    `weight` and `bias`, holding one chunk of `chunk_tokens` tokens' logits at a time.
    """
    if isinstance(hidden, DTensor):
        hidden = hidden.full_tensor()
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"hidden states {tuple(hidden.shape)} do not match labels {tuple(labels.shape)}")
    w_local, offset, group = _vocab_shard(weight)
    b_local = None
    if bias is not None:
        b_local = bias.to_local() if isinstance(bias, DTensor) else bias
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(vocab=w_local.shape[0], device=h2.device)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    grad_on = torch.is_grad_enabled()
    options = {
        "ignore_index": ignore_index,
        "chunk_tokens": int(chunk_tokens),
        "vocab_offset": offset,
        "group": group,
        "softcap": softcap,
        "scale": scale,
        "want_grads": (
            grad_on and h2.requires_grad,
            grad_on and w_local.requires_grad,
            grad_on and b_local is not None and b_local.requires_grad,
        ),
    }
    return _LinearCrossEntropy.apply(h2, w_local, b_local, labels.reshape(-1).to(h2.device), options)
