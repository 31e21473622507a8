"""Tiny configs for every causal LM in transformers' registry, from the config class's own defaults.

Only sizes are shrunk (layers, widths, heads, vocabulary, experts, MLA ranks, window lengths),
in nested sub-configs too (DBRX's attn_config and ffn_config); every other field keeps the config
class's default, so each model runs its own default math. The exceptions: dropout is switched off,
BERT-style encoders are made decoders, a config field a forward needs in place of an input training
does not pass is set (X-MOD's default_language), and fields that every released checkpoint sets but
the config class leaves unset or unusable are given checkpoint-like values (`CHECKPOINT_FIELDS`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from automodel.testing.tiny_model import TINY_MOE_SIZES, TINY_SIZES

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: The shared tiny sizes (`automodel.testing.tiny_model`) the sweep shrinks to; 4 layers and 256
#: positions are the sweep's own (pp2_ac runs two stages per rank; docs/models.md was measured so).
_W, _FFN, _HEADS, _KV = (
    TINY_SIZES[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
)
_VOCAB, _LAYERS, _POSITIONS = TINY_SIZES["vocab_size"], 4, 256
_EXPERTS, _TOP_K = TINY_MOE_SIZES["num_experts"], TINY_MOE_SIZES["num_experts_per_tok"]
_EXPERT_FFN = TINY_MOE_SIZES["moe_intermediate_size"]

#: Size fields and their tiny values, by the names configs use for them.
_SIZES: dict[str, int] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), _LAYERS),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), _W),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"), _FFN),
    "moe_intermediate_size": _EXPERT_FFN,
    "shared_expert_intermediate_size": _W,
    **dict.fromkeys(
        (
            "num_attention_heads",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "num_encoder_attention_heads",
            "num_decoder_attention_heads",
        ),
        _HEADS,
    ),
    **dict.fromkeys(
        ("encoder_layers", "decoder_layers", "num_encoder_layers", "num_decoder_layers"), _LAYERS
    ),
    **dict.fromkeys(("encoder_ffn_dim", "decoder_ffn_dim"), _FFN),
    **dict.fromkeys(("n_head", "n_heads", "num_heads"), _HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads"), _KV),
    "head_dim": _W // _HEADS,
    "vocab_size": _VOCAB,
    **dict.fromkeys(("max_position_embeddings", "n_positions"), _POSITIONS),
    **dict.fromkeys(("num_local_experts", "num_experts", "n_routed_experts"), _EXPERTS),
    "num_experts_per_tok": _TOP_K,
    "moe_num_experts": _EXPERTS,
    "moe_top_k": _TOP_K,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    # multi-head latent attention: ranks and the rope / no-rope parts of a head
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
    "vocab_size_per_layer_input": _VOCAB,
    "hidden_size_per_layer_input": 16,
    "laurel_rank": 8,
}

#: Sizes taken as ``min(default, tiny)`` (a top-k must not exceed the expert count).
_AT_MOST = ("num_experts_per_tok", "moe_top_k")

#: Fields that every released checkpoint of a model_type sets but whose config class leaves them
#: unset (None) or sized for the full model in a way the shrunk sizes contradict, so the class's
#: defaults alone cannot build the model. Values follow the released checkpoints' patterns.
CHECKPOINT_FIELDS: dict[str, dict[str, Any]] = {
    # DBRX reads attn_config.rope_theta (its checkpoints set it there; the class dropped the field)
    # and clamps q/k/v to clip_qkv (checkpoints: 8; its forward fails on the class's None)
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 500000.0, "clip_qkv": 8.0}},
    # dots.llm1: expert counts and top-k are None in the class (checkpoints: 128 experts, top-6, 2 shared)
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # LFM2-MoE: conv and full-attention layers (checkpoints interleave them; the class leaves None)
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    # Cohere Compass: RoPE parameters per layer type (the class leaves them empty)
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    },
    # GPT-Neo: the layer pattern is (types, repeats); 12 repeats of (global, local) is 24 layers
    "gpt_neo": {"attention_types": [[["global", "local"], 2]]},
    # Gemma 3n: the last layers share the earlier layers' KV cache; both kinds must produce and use it
    "gemma3n_text": {
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    },
    # Gemma 4: full-attention layers have their own (wider) heads, a per-layer override built from
    # global_head_dim (checkpoints: 512 beside head_dim 256)
    "gemma4_text": {"global_head_dim": 32},
    "gemma4_unified_text": {"global_head_dim": 32},
    # Qwen4-Exp: the indexed-attention layers' indexer sizes are None in the class
    "qwen4_exp_text": {
        "indexer_n_heads": 4,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
        "hc_lowrank": 16,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 4,
    },
    # Zamba: its shared attention block is tied across the hybrid layers, so it needs two of them
    # (the default pattern's first 4 layers hold one)
    "zamba": {
        "layer_types": ["linear_attention", "linear_attention", "hybrid", "hybrid"],
        "layers_block_type": ["linear_attention", "linear_attention", "hybrid", "hybrid"],
    },
    # Reformer: axial position embeddings factor the (training) sequence length and the width
    "reformer": {
        "is_decoder": True,  # its LM head asserts it; the class defaults to an encoder
        "axial_pos_shape": [4, 8],
        "axial_pos_embds_dim": [16, 48],
        "local_attn_chunk_length": 8,
        "lsh_attn_chunk_length": 8,
        "attention_head_size": 16,
    },
}

#: Token-id fields: kept inside the tiny vocabulary.
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id")

MODEL_TYPE_KEY = "model_type"

#: Registry entries that are not language models one trains on text alone (shown as n/a, why).
NOT_STANDALONE: dict[str, str] = {
    "gemma4_assistant": "a speculative-decoding drafter: every layer reads the key/value states of a target model",
    "gemma4_unified_assistant": "a speculative-decoding drafter: every layer reads the key/value states of a "
    "target model",
}


def _shrunk_sizes(config: PretrainedConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _SIZES.items():
        current = getattr(config, key, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > 0:
            out[key] = min(current, value) if key in _AT_MOST else value
    return out


def _sub_configs(config: PretrainedConfig) -> dict[str, Any]:
    """Nested configs that are parts of one model (DBRX's attn_config), not separate models."""
    from transformers import PretrainedConfig

    return {key: value for key, value in vars(config).items() if isinstance(value, PretrainedConfig)}


def tiny_overrides(config: PretrainedConfig) -> dict[str, Any]:
    """The fields to change on `config` (a transformers config with its defaults) to make it tiny."""
    config = copy.deepcopy(config)
    if hasattr(config, "allow_global_per_layer_attribute_access"):
        # heterogeneous configs (per-layer head sizes): the global values are the ones to shrink
        config.allow_global_per_layer_attribute_access = True
    out = _shrunk_sizes(config)
    for key, sub in _sub_configs(config).items():
        # a part (DBRX's ffn_config) or a whole sub-model (a VLM's text and vision configs): the
        # same rules, recursively
        if shrunk := tiny_overrides(sub):
            # per-layer overrides sized for the full layer count are rebuilt by the sub-config itself
            kept = {k: v for k, v in sub.to_diff_dict().items() if k != "per_layer_config"}
            out[key] = {**kept, **shrunk}
    experts = any(k in out for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    if experts and hasattr(config, "num_experts_per_tok") and "num_experts_per_tok" not in out:
        out["num_experts_per_tok"] = 2  # configs that leave top-k unset (None) by default
    heads = out.get("num_attention_heads") or out.get("n_head") or out.get("num_heads")
    width = out.get("hidden_size") or out.get("n_embd") or out.get("d_model")
    if heads and width:
        # left None by a class whose modeling reads them unguarded; these values are what a None
        # means everywhere else (a head is width / heads wide, one KV head per query head)
        if hasattr(config, "head_dim") and config.head_dim is None:
            out["head_dim"] = width // heads
        if hasattr(config, "num_key_value_heads") and config.num_key_value_heads is None:
            out["num_key_value_heads"] = heads
    expand = getattr(config, "expand", None)
    if isinstance(expand, int) and "num_heads" in out and "head_dim" in out and width:
        # Mamba-2: the SSM heads tile the expanded width
        out["num_heads"] = width * expand // out["head_dim"]
    if isinstance(getattr(config, "rotary_dim", None), int) and heads and width:
        out["rotary_dim"] = width // heads  # partial-rotary models: the rotary part of one head
    if "qk_rope_head_dim" in out:
        # multi-head latent attention: the rotary embedding's width is the rope part of a head
        out["head_dim"] = out["qk_rope_head_dim"]
        if "num_key_value_heads" in out and heads:
            out["num_key_value_heads"] = heads  # latent attention expands keys to every head
        if "qk_head_dim" in out:
            out["qk_head_dim"] = out["qk_rope_head_dim"] + out.get("qk_nope_head_dim", 0)
    layers = out.get("num_hidden_layers") or out.get("n_layer") or out.get("num_layers")
    for key, value in _SIZES.items():
        current = getattr(config, key, None)
        if isinstance(current, list) and current and all(isinstance(v, int) for v in current) and layers:
            out[key] = [value] * layers  # a size given per layer (Gemma 3n's intermediate_size)
    for key in ("layer_types", "mlp_layer_types", "layers_block_type"):
        current = getattr(config, key, None)
        if isinstance(current, list | tuple) and current and layers:
            out[key] = [current[i % len(current)] for i in range(layers)]
    for key in _TOKEN_IDS:
        current = getattr(config, key, None)
        if isinstance(current, int) and current >= out.get("vocab_size", 10**9):
            out[key] = 1
        elif isinstance(current, list) and any(isinstance(t, int) and t >= 256 for t in current):
            out[key] = [1]
    languages = getattr(config, "languages", None)
    if hasattr(config, "default_language") and config.default_language is None and languages:
        # X-MOD: training passes no lang_ids, so the config names the language (recipes.model_inputs)
        out["default_language"] = languages[0]
    if hasattr(config, "add_cross_attention") and not getattr(config, "is_decoder", True):
        out["is_decoder"] = True  # BERT-style encoders are causal LMs only as decoders
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key or "jitter" in key) and isinstance(value, float) and value > 0:
            out[key] = 0.0  # dropout and router jitter would make runs differ by RNG state
    for key, value in CHECKPOINT_FIELDS.get(getattr(config, MODEL_TYPE_KEY, ""), {}).items():
        out[key] = (
            {**out[key], **value} if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return {key: value for key, value in out.items() if settable(config, key, value)}


def settable(config: PretrainedConfig, key: str, value: Any) -> bool:
    """False for read-only fields (a property without setter, maybe behind an `attribute_map` alias,
    or one whose setter refuses, as ProphetNet's num_hidden_layers)."""
    probe = copy.deepcopy(config)
    try:
        setattr(probe, key, value)
    except (AttributeError, NotImplementedError):
        return False
    return True
