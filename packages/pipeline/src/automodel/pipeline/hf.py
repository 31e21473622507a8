"""Hugging Face decoder-only causal LMs: validation, stage FQNs, and the stage forward.

transformers is optional for this package; it is imported only when a stage builds its
attention masks, i.e. only when an HF model is being pipelined.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from automodel.pipeline.layout import split_layers_evenly


def _inner_model_name(model: nn.Module) -> str | None:
    prefix = getattr(model, "base_model_prefix", None) or "model"
    inner = getattr(model, prefix, None)
    return prefix if isinstance(inner, nn.Module) else None


def is_hf_causal_lm(model: nn.Module) -> bool:
    """Looks like ``XxxForCausalLM``: a ``config``, an inner model with ``layers``, an ``lm_head``."""
    name = _inner_model_name(model)
    return (
        getattr(model, "config", None) is not None
        and name is not None
        and isinstance(getattr(getattr(model, name), "layers", None), nn.ModuleList)
        and isinstance(getattr(model, "lm_head", None), nn.Module)
    )


def validate_hf_model_for_pipeline_support(model: nn.Module) -> None:
    """Reject what a layer-wise split cannot run: tied input/output embeddings (the two ends live
    on different ranks), encoder-decoder models, and models without a ModuleList of layers."""
    config = getattr(model, "config", None)
    cls = type(model).__name__
    if config is None:
        raise ValueError(f"{cls} has no .config; not a Hugging Face model (pass module_fqns_per_model_part)")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{cls} is an encoder-decoder model (config.is_encoder_decoder=True); only decoder-only causal LMs can be pipelined"
        )
    name = _inner_model_name(model)
    layers = getattr(getattr(model, name), "layers", None) if name else None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{cls} has no ModuleList of decoder layers at .{name or 'model'}.layers; "
            "pipelining splits models by that list"
        )
    if not isinstance(getattr(model, "lm_head", None), nn.Module):
        raise ValueError(f"{cls} has no lm_head; pipelining supports causal LMs (XxxForCausalLM)")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied_flag = bool(getattr(text_config, "tie_word_embeddings", False))
    embed = getattr(getattr(model, name), "embed_tokens", None)
    tied_weights = embed is not None and getattr(model.lm_head, "weight", None) is getattr(embed, "weight", 0)
    if tied_flag or tied_weights:
        raise ValueError(
            f"{cls} ties input and output embeddings (tie_word_embeddings=True); the embedding and LM head "
            "sit on different pipeline stages, so build the model with tie_word_embeddings=False"
        )


def hf_num_layers(model: nn.Module) -> int:
    name = _inner_model_name(model)
    assert name is not None, "validate_hf_model_for_pipeline_support runs first"
    return len(getattr(model, name).layers)


def hf_module_fqns_per_stage(model: nn.Module, *, num_stages: int) -> list[list[str]]:
    """Embeddings on the first stage, final norm and LM head on the last, the rotary embedding on
    every stage, decoder layers spread evenly (the remainder one each on the first stages)."""
    name = _inner_model_name(model)
    assert name is not None, "validate_hf_model_for_pipeline_support runs first"
    inner = getattr(model, name)
    ranges = split_layers_evenly(len(inner.layers), num_stages)
    parts: list[list[str]] = []
    for stage, layer_range in enumerate(ranges):
        fqns: list[str] = []
        if stage == 0 and getattr(inner, "embed_tokens", None) is not None:
            fqns.append(f"{name}.embed_tokens")
        fqns += [f"{name}.layers.{i}" for i in layer_range]
        if stage == num_stages - 1:
            if getattr(inner, "norm", None) is not None:
                fqns.append(f"{name}.norm")
            fqns.append("lm_head")
        if getattr(inner, "rotary_emb", None) is not None:
            fqns.append(f"{name}.rotary_emb")
        parts.append(fqns)
    return parts


_MASK_FUNCTIONS = {
    "full_attention": "create_causal_mask",
    "sliding_attention": "create_sliding_window_causal_mask",
    "chunked_attention": "create_chunked_causal_mask",
}


def _mask_builder(kind: str) -> Callable[..., Any]:
    import transformers.masking_utils as masking_utils

    fn_name = _MASK_FUNCTIONS.get(kind)
    if fn_name is None or not hasattr(masking_utils, fn_name):
        raise ValueError(f"attention type {kind!r} is not supported by the pipeline stage forward")
    return getattr(masking_utils, fn_name)


def _build_mask(kind: str, config: Any, hidden: torch.Tensor, position_ids: torch.Tensor) -> Any:
    """An HF causal mask for `kind` (None when the attention kernel can run is_causal itself)."""
    fn = _mask_builder(kind)
    params = inspect.signature(fn).parameters
    kwargs: dict[str, Any] = {"config": config, "attention_mask": None, "past_key_values": None}
    kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = hidden
    if "position_ids" in params:
        kwargs["position_ids"] = position_ids
    if "cache_position" in params:  # transformers < 5.x
        kwargs["cache_position"] = torch.arange(hidden.shape[1], device=hidden.device)
    return fn(**kwargs)


class CausalLMStage(nn.Module):
    """One pipeline stage of an HF causal LM, with the parameter FQNs of the full model.

    Input: token ids on the first stage, hidden states on the others; output: hidden states, or
    logits on the last stage. Attention is causal without padding masks (pad on the right and
    set the padded labels to -100).
    """

    def __init__(self, *, inner_name: str, inner: nn.Module, lm_head: nn.Module | None, config: Any) -> None:
        super().__init__()
        self._inner_name = inner_name
        setattr(self, inner_name, inner)
        self.lm_head = lm_head
        self.config = config

    def forward(self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        inner = getattr(self, self._inner_name)
        embed = getattr(inner, "embed_tokens", None)
        hidden = embed(inputs) if embed is not None else inputs
        batch, seq = hidden.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq, device=hidden.device).unsqueeze(0).expand(batch, seq)
        rotary = getattr(inner, "rotary_emb", None)
        position_embeddings = rotary(hidden, position_ids) if rotary is not None else None
        layer_types = getattr(self.config, "layer_types", None)
        masks: dict[str, Any] = {}
        for key, layer in inner.layers.named_children():
            kind = layer_types[int(key)] if layer_types else "full_attention"
            if kind not in masks:
                masks[kind] = _build_mask(kind, self.config, hidden, position_ids)
            out = layer(
                hidden,
                attention_mask=masks[kind],
                position_ids=position_ids,
                position_embeddings=position_embeddings,
                past_key_values=None,
                use_cache=False,
            )
            hidden = out[0] if isinstance(out, tuple) else out
        norm = getattr(inner, "norm", None)
        if norm is not None:
            hidden = norm(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        return hidden


def make_causal_lm_stage(pruned: nn.Module, *, config: Any) -> CausalLMStage:
    """Wrap a pruned ``XxxForCausalLM`` (see `split_module`) as a `CausalLMStage`."""
    name = _inner_model_name(pruned)
    assert name is not None, "the inner model is on the path of every stage"
    extra = [n for n, m in pruned.named_children() if m is not None and n not in (name, "lm_head")]
    if extra:
        raise ValueError(
            f"{type(pruned).__name__} has top-level modules {extra} the pipeline stage forward does not run"
        )
    return CausalLMStage(inner_name=name, inner=getattr(pruned, name), lm_head=pruned.lm_head, config=config)
