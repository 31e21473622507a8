"""The numbers of a model the estimates need: sizes from the HF config, parameter counts from the
meta-device model (exact for any architecture, nothing is allocated)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from automodel.mesh.model_parts import decoder_layers, input_embeddings, layer_values, text_config
from automodel.moe import find_moe_blocks
from automodel.recipes.model import build_meta_model, experts_per_token, num_experts

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_EXPERT = ".experts."


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a decoder-only causal LM; parameter counts are per layer averages (elements)."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool
    embed_params: int
    head_params: int  # lm_head (0 when tied) + final norm
    layer_dense_params: float  # per layer: attention, dense MLP, norms, router
    layer_expert_params: float  # per layer: routed experts (0 for dense models)
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    moe_layers: int = 0
    shared_intermediate: int = 0

    @property
    def total_params(self) -> int:
        per_layer = self.layer_dense_params + self.layer_expert_params
        return round(self.embed_params + self.head_params + self.layers * per_layer)

    @property
    def expert_params(self) -> int:
        return round(self.layers * self.layer_expert_params)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0 and self.moe_layers > 0

    @property
    def active_params(self) -> float:
        """Parameters one token passes through (embedding lookups excluded, top-k of the experts)."""
        per_layer = self.layer_dense_params
        if self.is_moe:
            per_layer += self.layer_expert_params * self.top_k / self.experts
        return self.head_params + self.layers * per_layer + (self.embed_params if self.tied_embeddings else 0)


def _int(hf_config: PretrainedConfig, *keys: str, default: int = 0) -> int:
    """The first of `keys` the config sets; for one that varies across layers (a heterogeneous
    config), its mean over the layers, which is what per-layer sums of the estimates need."""
    for key in keys:
        values = [v for v in layer_values(hf_config, key) if isinstance(v, int) and not isinstance(v, bool)]
        if values and all(v > 0 for v in values):
            return round(sum(values) / len(values))
    return default


def _expert_param_ids(model: Any) -> set[int]:
    """The routed experts' parameters as expert parallelism finds them (by structure: also JetMoE's
    `input_linear` and Doge's expert embedding tables, whose names do not say `experts`)."""
    return {id(b.experts.get_parameter(n)) for b in find_moe_blocks(model) for n in b.param_names}


def model_shape(
    hf_config: PretrainedConfig, *, trust_remote_code: bool = False, model: Any = None
) -> ModelShape:
    """Sizes from `hf_config`; parameter counts by walking the meta-device model's parameters.

    `model`: that meta-device model when the caller already built it (building a 70B model
    costs a fifth of a second; counts do not depend on its dtype)."""
    if model is None:
        model = build_meta_model(hf_config, dtype="float32", trust_remote_code=trust_remote_code)
    text = text_config(hf_config)  # a multimodal model's text decoder holds the sizes
    experts = num_experts(hf_config) or 0
    routed = _expert_param_ids(model) if experts else set()
    layer_list = decoder_layers(model)
    in_layers = {id(p) for layer in layer_list for p in layer.parameters()}
    embedding = input_embeddings(model)
    in_embedding = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    embed = head = dense = expert = 0
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied lm_head: counted once, as the embedding
            continue
        seen.add(id(p))
        n = p.numel()
        if id(p) in in_layers:
            if id(p) in routed or _EXPERT in f".{name}":
                expert += n
            else:
                dense += n
        elif id(p) in in_embedding:
            embed += n
        else:
            head += n
    layers = _int(text, "num_hidden_layers", "n_layer", "num_layers") or len(layer_list)
    # attention-free models (Mamba, RWKV, xLSTM) have no heads: no attention activations
    heads = _int(text, "num_attention_heads", "n_head", "num_heads")
    hidden = _int(text, "hidden_size", "d_model", "n_embd", "embedding_dim")
    moe_layers = 0
    if experts:
        moe_layers = sum(
            1
            for layer in layer_list
            if any(id(p) in routed or _EXPERT in f".{n}." for n, p in layer.named_parameters())
        )
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    return ModelShape(
        model_type=hf_config.model_type,
        hidden=hidden,
        intermediate=_int(text, "intermediate_size", "ffn_dim", default=4 * hidden),
        layers=layers,
        heads=heads,
        kv_heads=_int(text, "num_key_value_heads", default=heads),
        head_dim=_int(text, "head_dim", default=hidden // heads if heads else 0),
        vocab=_int(text, "vocab_size"),
        tied_embeddings=tied,
        embed_params=embed,
        head_params=head,
        layer_dense_params=dense / layers if layers else 0.0,
        layer_expert_params=expert / layers if layers else 0.0,
        experts=experts,
        top_k=(experts_per_token(hf_config) or 0) if experts else 0,
        moe_intermediate=_int(text, "moe_intermediate_size", "expert_intermediate_size") if experts else 0,
        moe_layers=moe_layers,
        shared_intermediate=_int(text, "shared_expert_intermediate_size") if experts else 0,
    )
