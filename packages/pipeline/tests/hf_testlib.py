"""Data and loss shared by the pipeline tests of Hugging Face models (one process vs stages)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 96, 12, 4


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s token ids and next-token labels; a few labels masked so the token count
    differs from the element count."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[0, -4:] = -100
    return ids, labels


def loss_of(logits: torch.Tensor, labels: torch.Tensor, tokens: int) -> torch.Tensor:
    """Summed token loss over the step's `tokens` (what each micro-batch contributes)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / tokens


def one_process(
    model: torch.nn.Module, *, lr: float, steps: int, micro: int | None = None
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """SGD `steps` of `model` in one process: each step's loss and gradients. `micro`: the batch
    split into micro-batches of that many rows, accumulated (the pipeline's arithmetic)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, grads = [], []
    for step in range(steps):
        ids, labels = batch(step)
        tokens, total = int((labels != -100).sum()), 0.0
        for rows in torch.arange(BATCH).split(micro or BATCH):
            loss = loss_of(model(input_ids=ids[rows]).logits, labels[rows], tokens)
            loss.backward()
            total += loss.item()
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return losses, grads


def pipelined_steps(pipe: Any, tokens: list[int], *, lr: float, steps: int) -> dict[str, Any]:
    """SGD `steps` through `pipe` (its loss_fn divides by ``tokens[0]``, set here per step): the
    losses, this rank's gradients, the parameters it holds and its tied ones."""
    opt = torch.optim.SGD(list(pipe.parameters()), lr=lr)
    out: dict[str, Any] = {"losses": [], "grads": [], "held": sorted(n for n, _ in pipe.named_parameters())}
    out["tied"] = pipe.tied_parameters.names
    for step in range(steps):
        ids, labels = batch(step)
        tokens[0] = int((labels != -100).sum())
        loss = pipe.reduce_loss(pipe.step(ids, labels=labels))
        pipe.sync_tied_gradients()
        out["losses"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return out
