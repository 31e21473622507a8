"""Sizes of a transformers config: the text decoder's, per layer.

A heterogeneous config (transformers' ``per_layer_config``: Gemma 4's wider full-attention heads,
per-layer head counts) has no single value of the attributes that vary across its layers, and
transformers raises when one is read globally. Layout rules read them here, one value per layer.
"""

from __future__ import annotations

from typing import Any


def layer_values(config: Any, key: str) -> list[Any]:
    """`key` of every decoder layer for an attribute that varies across layers, else its one global
    value (None where the config lacks it)."""
    if key in (getattr(config, "per_layer_attributes", None) or ()):
        return [getattr(layer, key, None) for layer in config.per_layer_config]
    return [getattr(config, key, None)]


def positive_ints(config: Any, key: str) -> list[int]:
    """The distinct positive int values `key` takes over the layers, ascending (empty if unset)."""
    values = layer_values(config, key)
    return sorted({v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0})


def head_dims(config: Any) -> list[int]:
    """Every attention head width the layers use (``head_dim``, else hidden_size / heads)."""
    dims = positive_ints(config, "head_dim")
    if dims:
        return dims
    hidden = getattr(config, "hidden_size", 0) or 0
    return sorted({hidden // heads for heads in positive_ints(config, "num_attention_heads") if hidden})
