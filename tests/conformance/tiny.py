"""Tiny configs for every causal LM in transformers' registry, from the config class's own defaults.

Only sizes are shrunk (layers, widths, heads, vocabulary, experts, MLA ranks, window lengths);
every other field keeps the config class's default, so each model runs its own default math. The
exceptions: dropout is switched off, BERT-style encoders are made decoders, and a config field a
forward needs in place of an input training does not pass is set (X-MOD's default_language).
"""

from __future__ import annotations

from typing import Any

#: Size fields and their tiny values, by the names configs use for them.
_SIZES: dict[str, int] = {
    "num_hidden_layers": 4,
    "n_layer": 4,
    "num_layers": 4,
    "n_layers": 4,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "ffn_hidden_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "n_positions": 256,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "qk_head_dim": 16,
    "v_head_dim": 16,
}

#: Token-id fields: kept inside the tiny vocabulary.
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id", "sep_token_id")

MODEL_TYPE_KEY = "model_type"


def tiny_overrides(config: Any) -> dict[str, Any]:
    """The fields to change on `config` (a transformers config with its defaults) to make it tiny."""
    out: dict[str, Any] = {}
    for key, value in _SIZES.items():
        current = getattr(config, key, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > 0:
            out[key] = min(current, value) if key in ("num_experts_per_tok",) else value
    experts = any(k in out for k in ("num_local_experts", "num_experts", "n_routed_experts"))
    if experts and hasattr(config, "num_experts_per_tok") and "num_experts_per_tok" not in out:
        out["num_experts_per_tok"] = 2  # configs that leave top-k unset (None) by default
    heads = out.get("num_attention_heads") or out.get("n_head") or out.get("num_heads")
    width = out.get("hidden_size") or out.get("n_embd") or out.get("d_model")
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
    return out
