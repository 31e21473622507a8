"""The layout report finds the decoder layers of hybrid models, whole and as pipeline stages.

OLMo-Hybrid builds its layer list from two classes (linear-attention and attention layers); the
report found no layer list, so the conformance check could not tell whether FSDP, TP or the
pipeline split had been applied to its layers.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.pipeline import validate_hf_model_for_pipeline_support
from automodel.pipeline.hf import hf_module_fqns_per_stage, make_causal_lm_stage
from automodel.pipeline.split import split_module
from automodel.recipes.layout_report import describe_part


def _olmo_hybrid() -> torch.nn.Module:
    config = AutoConfig.for_model(
        "olmo_hybrid",
        num_hidden_layers=4,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        pad_token_id=1,
        eos_token_id=1,
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_layers_of_two_classes_are_reported() -> None:
    model = _olmo_hybrid()
    assert len({type(layer) for layer in model.get_submodule("model.layers").children()}) == 2
    report = describe_part(model)
    assert report["layers_fqn"] == "model.layers"
    assert report["layers"] == [0, 1, 2, 3]


def test_a_pipeline_stage_reports_the_layers_it_holds() -> None:
    model = _olmo_hybrid()
    structure = validate_hf_model_for_pipeline_support(model)
    fqns = hf_module_fqns_per_stage(model, num_stages=2, structure=structure)
    part = split_module(model, fqns=fqns[1])
    stage = make_causal_lm_stage(part, model=model, structure=structure, stage_index=1, num_stages=2)
    report = describe_part(stage, stage_ids=[1])
    assert report["layers_fqn"] == "model.layers"
    assert report["layers"] == [2, 3]
