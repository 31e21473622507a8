"""The tiny causal LM every package's tests train, built in one place so they all train the same.

Llama-shaped (4 heads over 2 KV heads of 16, untied head); the same sizes go into the recipes
tests' YAML ``model.config`` sections (`TINY_SIZES`). transformers is optional in this package:
the builders import it when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PretrainedConfig, PreTrainedModel

#: Sizes of the tiny decoder, as HF config fields (the head dimension is hidden / heads = 16).
TINY_SIZES: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
#: The MoE fields of the tiny Qwen3-MoE (4 experts, top-2, every layer sparse).
TINY_MOE_SIZES: dict[str, Any] = {
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def tiny_config(
    model_type: str = "llama", *, layers: int = 2, attn: str = "sdpa", **overrides: Any
) -> PretrainedConfig:
    """`TINY_SIZES` (plus `TINY_MOE_SIZES` for ``qwen3_moe``) as a config of `model_type`, with
    `layers` decoder layers, `attn` attention and `overrides` on top."""
    from transformers import AutoConfig  # optional dependency of this package

    fields = {**TINY_SIZES, "num_hidden_layers": layers}
    # head_dim explicit: some families (Qwen3) default it to 128 instead of hidden / heads
    fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if model_type == "qwen3_moe":
        fields.update(TINY_MOE_SIZES)
    config = AutoConfig.for_model(model_type, **{**fields, **overrides})
    config._attn_implementation = attn
    return config


def tiny_causal_lm(
    model_type: str = "llama",
    *,
    layers: int = 2,
    seed: int = 0,
    meta: bool = False,
    attn: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """A seeded fp32 causal LM of `tiny_config` (identical on every rank for the same seed); on the
    meta device with `meta`."""
    from transformers import AutoModelForCausalLM  # optional dependency of this package

    config = tiny_config(model_type, layers=layers, attn=attn, **overrides)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config).float()
    return AutoModelForCausalLM.from_config(config).float()


def tiny_llama(*, layers: int = 2, seed: int = 0, attn: str = "sdpa", **overrides: Any) -> LlamaForCausalLM:
    """`tiny_causal_lm` of ``llama``, typed as the class it is."""
    return cast("LlamaForCausalLM", tiny_causal_lm("llama", layers=layers, seed=seed, attn=attn, **overrides))
