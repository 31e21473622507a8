"""Buffers a model computes at construction come back after meta-device init, from the model's own
code: rotary frequencies, Gemma's embedding scale, the router correction bias of DeepSeek-V3 /
GLM-4-MoE / LongCat-Flash, Apertus' activation constants; parameters keep their seeded values, also
those of submodules the model's init code re-draws."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.fsdp2 import materialize_meta_model
from automodel.fsdp2.meta_init import _seed_for, default_init_fn

DENSE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}
ROUTED = {
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
}
CONFIGS = {
    "llama": {**DENSE, "num_attention_heads": 4, "num_key_value_heads": 2},
    "gemma3_text": {**DENSE, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    # XIELU activation constants: restored by re-creating the enclosing MLP from the config
    "apertus": {**DENSE, "num_attention_heads": 4, "num_key_value_heads": 2},
    "deepseek_v3": {
        **DENSE,
        **ROUTED,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "first_k_dense_replace": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    },
    "glm4_moe": {
        **DENSE,
        **ROUTED,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "first_k_dense_replace": 1,
    },
    # The router's _init_weights (called to restore its correction bias) also re-draws its child
    # classifier.weight from the global RNG: the seeded value must survive.
    "longcat_flash": {
        **DENSE,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": 4,
        "zero_expert_num": 4,
        "num_experts_per_tok": 2,
        "expert_ffn_hidden_size": 32,
        "ffn_hidden_size": 128,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "head_dim": 8,
    },
}


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_meta_init_restores_computed_buffers_and_keeps_seeded_parameters(model_type: str) -> None:
    config = AutoConfig.for_model(model_type, **CONFIGS[model_type])
    reference = AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    materialize_meta_model(model, device="cpu", seed=3)
    expected = dict(reference.named_buffers())
    assert expected, "the model computes no buffer: nothing is tested"
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, expected[name], rtol=0, atol=0, msg=name)
    init = default_init_fn(float(config.initializer_range))
    for name, param in model.named_parameters():  # the buffers' modules kept the seeded values
        want = torch.empty(param.shape, dtype=param.dtype)
        init(name, want, torch.Generator().manual_seed(_seed_for(3, name)))
        assert torch.equal(param, want), name


def test_buffer_no_code_can_recompute_is_a_clear_error() -> None:
    class Scaled(nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.register_buffer("scale", torch.tensor(scale))

    with torch.device("meta"):
        module = nn.Sequential(Scaled(2.0))
    with pytest.raises(ValueError, match=r"cannot recompute buffers \['scale'\] of Scaled"):
        materialize_meta_model(module, device="cpu")
