"""The tiny causal LMs every package's tests train, built in one place so they all train the same.

Llama-shaped (4 heads over 2 KV heads of 16, untied head); the same sizes go into the recipes
tests' YAML ``model.config`` sections (`TINY_SIZES`). The MoE families (`MOE_FAMILIES`) add
experts under each family's own field names, and GPT-2 (decoder layers at ``transformer.h``, tied
embeddings, Conv1D projections) gets the same width under its names. transformers is optional in
this package: the builders import it when called.
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

#: Each MoE family's names for (expert count, top-k, one expert's MLP width): the families differ
#: (Mixtral's experts are ``intermediate_size`` wide, Qwen's ``moe_intermediate_size``).
MOE_FIELD_NAMES: dict[str, tuple[str, str, str]] = {
    "mixtral": ("num_local_experts", "num_experts_per_tok", "intermediate_size"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
}
#: The MoE families the builders know (`MOE_FIELD_NAMES`).
MOE_FAMILIES: tuple[str, ...] = tuple(MOE_FIELD_NAMES)

_EXPERTS, _TOP_K = TINY_MOE_SIZES["num_experts"], TINY_MOE_SIZES["num_experts_per_tok"]
_EXPERT_WIDTH = TINY_MOE_SIZES["moe_intermediate_size"]
#: Fields a family needs beside the sizes: every Qwen layer sparse.
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen2_moe": {"decoder_sparse_step": 1, "mlp_only_layers": []},
}


def _gpt2_fields(layers: int) -> dict[str, Any]:
    """`TINY_SIZES`' width, heads, vocabulary and positions under GPT-2's names; dropout off (runs
    must not differ by RNG state) and the special tokens inside the tiny vocabulary."""
    return {
        "n_embd": TINY_SIZES["hidden_size"],
        "n_layer": layers,
        "n_head": TINY_SIZES["num_attention_heads"],
        "vocab_size": TINY_SIZES["vocab_size"],
        "n_positions": TINY_SIZES["max_position_embeddings"],
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }


def moe_fields(model_type: str, *, experts: int, top_k: int, expert_width: int) -> dict[str, Any]:
    """`experts` experts of `expert_width`, `top_k` per token, under `model_type`'s field names
    (Qwen2-MoE's shared expert as wide as a routed one)."""
    if model_type not in MOE_FIELD_NAMES:
        raise ValueError(f"model_type must be one of {MOE_FAMILIES} for experts, got {model_type!r}")
    fields = {
        **_FAMILY_FIELDS.get(model_type, {}),
        **dict(zip(MOE_FIELD_NAMES[model_type], (experts, top_k, expert_width))),
    }
    if model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = expert_width
    return fields


def tiny_fields(model_type: str = "llama", *, layers: int = 2) -> dict[str, Any]:
    """The HF config fields of the tiny `model_type` with `layers` decoder layers: `TINY_SIZES`
    (under GPT-2's names for ``gpt2``), plus 4 experts, top-2, of width 32 for an MoE family."""
    if model_type == "gpt2":
        return _gpt2_fields(layers)
    fields = {**TINY_SIZES, "num_hidden_layers": layers}
    # head_dim explicit: some families (Qwen3) default it to 128 instead of hidden / heads
    fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if model_type in MOE_FIELD_NAMES:
        fields.update(moe_fields(model_type, experts=_EXPERTS, top_k=_TOP_K, expert_width=_EXPERT_WIDTH))
    return fields


def tiny_config(
    model_type: str = "llama", *, layers: int = 2, attn: str = "sdpa", **overrides: Any
) -> PretrainedConfig:
    """`tiny_fields` as a config of `model_type`, with `layers` decoder layers, `attn` attention and
    `overrides` on top (a ``hidden_size`` override without ``head_dim`` keeps hidden / heads)."""
    # lazy: optional dependency of this package (transformers)
    from transformers import AutoConfig

    fields = tiny_fields(model_type, layers=layers)
    if "head_dim" in fields and "hidden_size" in overrides and "head_dim" not in overrides:
        heads = overrides.get("num_attention_heads", fields["num_attention_heads"])
        fields["head_dim"] = overrides["hidden_size"] // heads
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
    # lazy: optional dependency of this package (transformers)
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, layers=layers, attn=attn, **overrides)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config).float()
    return AutoModelForCausalLM.from_config(config).float()


def tiny_llama(*, layers: int = 2, seed: int = 0, attn: str = "sdpa", **overrides: Any) -> LlamaForCausalLM:
    """`tiny_causal_lm` of ``llama``, typed as the class it is."""
    return cast("LlamaForCausalLM", tiny_causal_lm("llama", layers=layers, seed=seed, attn=attn, **overrides))
