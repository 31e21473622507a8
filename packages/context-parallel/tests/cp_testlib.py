"""The loss every CP parity test of this package uses (CPU and GPU); the tiny model is the shared one
(`automodel.testing.tiny_model`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from automodel.testing.tiny_model import TINY_SIZES

VOCAB: int = TINY_SIZES["vocab_size"]


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy (the caller divides by the global label-token count)."""
    return F.cross_entropy(
        logits.reshape(-1, VOCAB).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
