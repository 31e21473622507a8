"""Tiny Hugging Face MoE models for tests and benchmarks (transformers imported lazily)."""

from __future__ import annotations

import importlib

import torch
from torch import nn

#: The MoE families parallelize_model is tested on.
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen3_moe", "qwen2_moe")


def tiny_config(
    family: str,
    *,
    num_experts: int = 8,
    top_k: int = 2,
    layers: int = 2,
    hidden: int = 64,
    expert_intermediate: int = 32,
    aux_loss_coef: float = 0.01,
) -> object:
    """A small config of `family` ("mixtral", "qwen3_moe", "qwen2_moe" or the dense "llama")."""
    common = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    moe = dict(num_experts_per_tok=top_k, router_aux_loss_coef=aux_loss_coef, output_router_logits=True)
    if family == "mixtral":
        # optional dependency of this package
        from transformers import MixtralConfig

        cfg = MixtralConfig(
            intermediate_size=expert_intermediate, num_local_experts=num_experts, **moe, **common
        )
    elif family == "qwen3_moe":
        # optional dependency of this package
        from transformers import Qwen3MoeConfig

        cfg = Qwen3MoeConfig(
            intermediate_size=2 * hidden,
            moe_intermediate_size=expert_intermediate,
            num_experts=num_experts,
            norm_topk_prob=True,
            head_dim=hidden // 4,  # pyright: ignore[reportCallIssue]  # configs take extra keys at run time
            **moe,
            **common,
        )
    elif family == "qwen2_moe":
        # optional dependency of this package
        from transformers import Qwen2MoeConfig

        cfg = Qwen2MoeConfig(
            intermediate_size=2 * hidden,
            moe_intermediate_size=expert_intermediate,
            shared_expert_intermediate_size=expert_intermediate,
            num_experts=num_experts,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **moe,
            **common,
        )
    elif family == "llama":
        # optional dependency of this package
        from transformers import LlamaConfig

        cfg = LlamaConfig(intermediate_size=2 * hidden, **common)
    else:
        raise ValueError(f"family must be one of {(*MOE_FAMILIES, 'llama')}, got {family!r}")
    cfg._attn_implementation = "sdpa"
    return cfg


def build_tiny_model(family: str, *, seed: int = 0, **config_kwargs: object) -> nn.Module:
    """A seeded fp32 causal LM of `family`; identical on every rank for the same seed."""
    # optional dependency of this package
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, **config_kwargs)).float()


def preload(families: tuple[str, ...] = (*MOE_FAMILIES, "llama")) -> None:
    """Import the modeling modules and torch's lazily imported parts once, before ranks are forked.

    Otherwise every forked rank imports them itself, which on a small machine costs far more
    than the test.
    """
    import torch._dynamo  # noqa: F401  (FSDP2 and checkpoint import it lazily)
    import torch.distributed.fsdp  # noqa: F401

    for family in families:
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
