"""The model facts every package reads in `automodel.mesh.model_parts`: the decoder layers of dense
and MoE models (with the ModuleDict fallbacks expert parallelism needs), the config facts (per-layer
values, head widths, expert counts) and the names of parameters and modules without wrapper atoms.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from automodel.mesh.model_parts import (
    WRAPPER_ATOMS,
    canonical_fqn,
    config_int,
    decoder_layers,
    experts_per_token,
    find_layer_list,
    head_dims,
    layer_values,
    num_experts,
    positive_ints,
)

pytest.importorskip("transformers")

from automodel.testing.tiny_model import MOE_FAMILIES, MOE_FIELD_NAMES, tiny_causal_lm, tiny_config  # noqa: E402

FAMILIES = ("llama", "qwen3", "gpt2", *MOE_FAMILIES)
LAYERS_FQN = {"gpt2": "transformer.h"}


# --- layer finding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_layers_of_the_tiny_families(family: str) -> None:
    """Dense, GPT-2 and MoE: one finder (`find_layer_list` / `decoder_layers`), the model's blocks."""
    model = tiny_causal_lm(family, layers=3, meta=True)
    fqn = LAYERS_FQN.get(family, "model.layers")
    found = find_layer_list(model)
    assert found is not None and found[0] == fqn
    assert decoder_layers(model) == list(model.get_submodule(fqn))
    if family in MOE_FAMILIES:  # every experts module lies in a found block
        experts = [n for n, _ in model.named_modules() if n.endswith(".experts")]
        assert len(experts) == 3
        assert all(any(e.startswith(f"{fqn}.{i}.") for i in range(3)) for e in experts)


def test_no_layers() -> None:
    assert find_layer_list(nn.Sequential(nn.Linear(2, 2))) is None
    assert decoder_layers(nn.Sequential(nn.Linear(2, 2))) == []


# --- config facts --------------------------------------------------------------------------------


def test_per_layer_values() -> None:
    per_layer = SimpleNamespace(
        per_layer_attributes=("num_attention_heads", "head_dim"),
        per_layer_config=[
            SimpleNamespace(num_attention_heads=4, head_dim=16),
            SimpleNamespace(num_attention_heads=8, head_dim=32),
            SimpleNamespace(num_attention_heads=4, head_dim=16),
        ],
        hidden_size=64,
        num_key_value_heads=2,
    )
    assert layer_values(per_layer, "num_attention_heads") == [4, 8, 4]
    assert layer_values(per_layer, "num_key_value_heads") == [2]
    assert layer_values(per_layer, "missing") == [None]
    assert positive_ints(per_layer, "num_attention_heads") == [4, 8]
    assert head_dims(per_layer) == [16, 32]
    # no head_dim: hidden / heads; bools and non-positive values are not sizes
    plain = SimpleNamespace(hidden_size=64, num_attention_heads=4, head_dim=None, flag=True, zero=0)
    assert head_dims(plain) == [16]
    assert positive_ints(plain, "flag") == positive_ints(plain, "zero") == []


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", *MOE_FAMILIES])
def test_expert_counts_of_the_tiny_families(family: str) -> None:
    config = tiny_config(family)
    if family in MOE_FAMILIES:
        count, top_k, _ = MOE_FIELD_NAMES[family]
        assert num_experts(config) == getattr(config, count) == 4
        assert experts_per_token(config) == getattr(config, top_k) == 2
    else:
        assert num_experts(config) is None and experts_per_token(config) is None
    assert head_dims(config) == [16]


def test_expert_counts_in_a_part_config() -> None:
    """DBRX keeps them in ``ffn_config`` (a config of its own); plain attributes are not searched."""
    from transformers import DbrxConfig  # lazy: only this test needs DBRX's config class

    dbrx = DbrxConfig(ffn_config={"moe_num_experts": 8, "moe_top_k": 2})
    assert num_experts(dbrx) == 8 and experts_per_token(dbrx) == 2
    holder = SimpleNamespace(part=SimpleNamespace(num_experts=8))
    assert config_int(holder, ("num_experts",)) is None


# --- names without wrapper atoms -----------------------------------------------------------------


def test_canonical_names_of_wrapped_modules() -> None:
    """Checkpoint wrapper per layer, then compile of the whole model: the bare model's names."""
    bare = tiny_causal_lm("llama", layers=2, meta=True)
    names = [n for n, _ in bare.named_parameters()]
    for i, layer in enumerate(list(bare.model.layers)):
        bare.model.layers[i] = checkpoint_wrapper(layer)
    compiled = cast(nn.Module, torch.compile(bare))  # wraps now, compiles at the first call
    wrapped = [n for n, _ in compiled.named_parameters()]
    assert wrapped != names and all("_orig_mod." in n for n in wrapped)
    assert any("_checkpoint_wrapped_module." in n for n in wrapped)
    assert [canonical_fqn(n) for n in wrapped] == names
    assert {canonical_fqn(n) for n, _ in compiled.named_modules()} >= {"", "model.layers.0", "lm_head"}


@pytest.mark.parametrize(
    ("name", "bare"),
    [
        (
            "module.model.layers.0.mlp.up_proj.weight",
            "model.layers.0.mlp.up_proj.weight",
        ),  # DDP, megatron-fsdp
        ("_fsdp_wrapped_module.model.embed_tokens.weight", "model.embed_tokens.weight"),  # FSDP1
        ("model.layers.3._orig_mod._checkpoint_wrapped_module.self_attn", "model.layers.3.self_attn"),
        ("module._orig_mod.lm_head.weight", "lm_head.weight"),
        ("model.layers.0", "model.layers.0"),
        ("module", ""),
        ("", ""),
    ],
)
def test_canonical_fqn(name: str, bare: str) -> None:
    assert canonical_fqn(name) == bare
    assert canonical_fqn(bare) == bare
    assert not set(bare.split(".")) & set(WRAPPER_ATOMS)
