"""Loss functions return the SUM of token losses; the loop divides by the global label-token count."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def masked_cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """Sum (not mean) of token cross-entropy in fp32, so micro-batches and ranks add up exactly."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=ignore_index,
        reduction="sum",
    )
