"""The tiny model and loss every CP parity test of this package uses (CPU and GPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

VOCAB = 256


def tiny_llama(family: str = "llama") -> LlamaForCausalLM | Qwen3ForCausalLM:
    """A 2-layer Llama (or Qwen3) in fp32 with SDPA attention, seeded so every caller gets the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    if family == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kwargs)).float()
    return LlamaForCausalLM(LlamaConfig(**kwargs)).float()


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy (the caller divides by the global label-token count)."""
    return F.cross_entropy(
        logits.reshape(-1, VOCAB).float(), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
