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


class LinearCrossEntropy:
    """The default loss of causal LMs: the same sum of token cross-entropy, computed from the hidden
    states and the head's weight in chunks of tokens, so the full logits never exist.

    ``loss_fn: {_target_: automodel.recipes.loss.LinearCrossEntropy, chunk_tokens: 1024}`` sets the
    chunk (default: a power of two keeping one chunk's fp32 logits at 128 MiB on CPU, 512 MiB on
    GPUs). Families whose logits the chunked path cannot reproduce keep the full logits, said in
    one log line at start (`automodel.recipes.output_head`).
    """

    reads_hidden_states = True

    def __init__(self, chunk_tokens: int | None = None) -> None:
        if chunk_tokens is not None and (
            isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1
        ):
            raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
        self.chunk_tokens = chunk_tokens

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """On logits (a path without a head to read), the plain sum of token cross-entropy."""
        return masked_cross_entropy_sum(logits, labels)

    def __repr__(self) -> str:
        return f"LinearCrossEntropy(chunk_tokens={self.chunk_tokens})"
