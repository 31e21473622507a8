"""GPT-2 keeps its decoder layers at ``transformer.h`` (not ``*layers``) and ties its embeddings:
activation checkpointing, compile, prefetch and TP's every-layer check find them as the pipeline
does (`automodel.mesh.model_parts`), on a real transformers GPT-2 (tiny)."""

from __future__ import annotations

import pytest
import torch
from fsdp2_testlib import batch, loss_sum, reference, tiny_model, train_on_rank
from transformers import GPT2LMHeadModel

from automodel.mesh.model_parts import decoder_layers, find_layer_list, tied_weight_modules
from automodel.testing.ranks import run_on_ranks


def test_introspection_finds_gpt2_parts() -> None:
    from automodel.mesh.model_parts import input_embeddings, output_embeddings, parameter_places

    model = tiny_model(family="gpt2", layers=3, meta=True)
    assert isinstance(model, GPT2LMHeadModel)
    found = find_layer_list(model)
    assert found is not None
    name, layers = found
    assert name == "transformer.h" and len(layers) == 3
    assert decoder_layers(model) == list(model.transformer.h)
    assert input_embeddings(model) is model.transformer.wte
    assert output_embeddings(model) is model.lm_head
    assert tied_weight_modules(model) == {"transformer.wte", "lm_head"}
    places = parameter_places(model)[id(model.lm_head.weight)]
    assert sorted(places) == [("lm_head", "weight"), ("transformer.wte", "weight")]


def test_activation_checkpointing_and_compile_wrap_every_gpt2_layer() -> None:
    from automodel.fsdp2 import apply_activation_checkpointing, apply_compile

    model = tiny_model(family="gpt2", layers=3)
    assert isinstance(model, GPT2LMHeadModel)
    ids = batch(0)[:2]
    want = loss_sum(model, ids)
    assert apply_activation_checkpointing(model) == 3
    assert all(hasattr(m, "_checkpoint_wrapped_module") for m in model.transformer.h)
    assert torch.equal(loss_sum(model, ids), want)
    assert apply_compile(model, backend="eager") == 3


def test_tp_every_layer_check_reaches_gpt2_layers() -> None:
    """A plan that shards layer 0 only leaves layer 1 replicated: refused (it was skipped)."""
    from automodel.fsdp2.tp_plan import check_plan_shards_every_layer, explicit_plan

    model = tiny_model(family="gpt2", meta=True)
    with pytest.raises(ValueError, match=r"decoder layers \['1'\]"):
        check_plan_shards_every_layer(model, explicit_plan({"transformer.h.0.mlp.c_fc": "colwise"}))


def test_gpt2_ac_and_prefetch_match_one_process() -> None:
    spec = {
        "family": "gpt2",
        "layers": 3,
        "config": {"activation_checkpointing": True, "enable_fsdp2_prefetch": True},
    }
    got = run_on_ranks(train_on_rank, world_size=2, args=(spec,), timeout_s=300)[0]["losses"]
    ref = reference(family="gpt2", layers=3)["losses"]
    for g, r in zip(got, ref, strict=True):
        assert abs(g - r) <= 1e-5 * abs(r), (got, ref)
