"""The conformance sweep's representative subset (one model per family), part of the CPU suite.

Each case trains the tiny config of a registry model_type through the recipes' code path, once in
one process and once under a layout, and must either pass (loss and gradient norm of every step
within 1e-5 relative, the layout really applied on every rank) or be refused before launch with
the expected reason. The full sweep (`nox -s conformance`) writes docs/models.md.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from matrix import (  # noqa: E402
    LAYOUTS,
    RTOL,
    Refused,
    _model_facts,
    check_applied,
    max_relative_difference,
    recipe_config,
    run_case,
    tiny_model_config,
)

PASS = "pass"

# (model_type, variant, layout, expected: "pass" or a substring of the refusal)
CASES = [
    ("llama", "default", "tp2_sp", PASS),  # Llama-like
    ("llama", "tie_flipped", "pp2", PASS),  # tied embedding held by both end stages
    ("llama", "default", "cp2", PASS),
    ("gemma3_text", "options", "pp2", PASS),  # embedding scale, soft-capping, sliding window 8 < 32
    ("gemma3_text", "options", "tp2", PASS),
    ("gemma3_text", "options", "pp2_ac", PASS),  # 4 stages on 2 ranks, checkpointed layers
    ("gemma3_text", "default", "tp2_sp", PASS),  # pre-/post-feed-forward norms on the sequence-sharded stream
    ("gemma3_text", "options", "cp2", "sliding-window attention"),
    ("granite", "options", "pp2", PASS),  # embedding/residual/attention multipliers, logit scaling
    ("cohere", "default", "tp2", PASS),  # logit scale, tied embeddings kept replicated over tp
    ("cohere", "options", "tp2", "one entry per attention head"),  # per-head qk-norm weights
    (
        "glm4_moe",
        "options",
        "tp2",
        PASS,
    ),  # q/k norm its own plan omits: grads summed over tp (was 1.8e-5 off)
    ("apertus", "default", "tp2", PASS),  # xIELU's learned scalars on the sharded MLP width (was 3e-5 off)
    (
        "minicpm3",
        "default",
        "tp2",
        PASS,
    ),  # latent attention: shared rope key's grad summed over tp (was 3e-4 off)
    ("deepseek_v3", "default", "ep2", PASS),  # latent attention, MoE router correction bias
    ("deepseek_v3", "default", "pp2", PASS),
    # 2 key/value heads under 4: trains in one process (sdpa, no mask); the split's trace once ran
    # eager attention with a mask, which repeats the latent keys' heads, and refused it
    ("deepseek_v3", "fewer_kv_heads", "pp2", PASS),
    ("gpt_oss", "default", "pp2", PASS),  # attention sinks, MoE
    ("gpt_oss", "default", "ep2", PASS),  # transposed, interleaved experts with biases: their own forward
    ("longcat_flash", "default", "ep2", "different expert counts on dim 0"),  # identity (zero) experts
    ("gpt_oss", "default", "cp2", "attention sinks"),
    ("gpt2", "default", "pp2", PASS),  # learned positions, another naming scheme
    ("gpt2", "default", "tp2", "declares no tensor-parallel plan"),
    ("cpmant", "default", "pp2", "takes no inputs_embeds"),  # its forward reads token ids only
    ("stablelm", "default", "tp2", "declares no tensor-parallel plan"),  # views with the global head count
    ("qwen3_5_text", "default", "cp2", "linear_attention layers"),  # a chunk-local recurrence: was 6e-2 off
    ("gpt2", "default", "cp2", PASS),  # attention module named `attn`, found by its dispatch to transformers
    ("bloom", "default", "cp2", "computes attention inside BloomAttention"),  # ALiBi in its own code
    ("gemma4_text", "default", "fsdp2", PASS),  # heterogeneous config: wider heads in full-attention layers
    (
        "gemma4_text",
        "default",
        "tp2_sp",
        "modules with weights besides self_attn and mlp",
    ),  # per-layer inputs
    ("reformer", "default", "fsdp2", "reversible residual layers"),  # recomputes layers inside its backward
    (
        "gemma3n_text",
        "default",
        "tp2",
        "activation_sparsity_pattern",
    ),  # top-k over the MLP width: was 5e-2 off
    ("zamba", "default", "fsdp2", PASS),  # one attention block tied into two layers: one FSDP unit
    ("gemma3", "default", "tp2", PASS),  # multimodal: the text decoder's layers, not the vision tower's
    ("gemma3", "default", "cp2", PASS),  # the vision tower's own attention does not run on text
    ("git", "default", "cp2", "computes attention inside GitAttention"),  # beside a dispatching vision tower
    ("gemma4", "tie_flipped", "tp2", "reads embed_tokens.weight directly"),  # a vocab shard would crash
    # composed layouts on 4 ranks: every axis's check on every rank
    ("gemma3_text", "options", "tp2_pp2", PASS),  # scaling, soft-capping, sliding window under TP x PP
    ("llama", "tie_flipped", "cp2_pp2", PASS),  # CP inside every stage, tied embedding on both ends
    ("gemma3n_text", "default", "cp2_pp2", PASS),  # carried per-layer inputs, sharded over cp
    ("deepseek_v3", "default", "ep2_pp2", PASS),  # MLA, router bias; experts split on each stage
    ("deepseek_v3", "default", "ep2_pp2_ac", PASS),  # a stage holding only its dense first layer
    ("gemma3_text", "default", "tp2_sp_pp2", PASS),  # sequence-sharded hidden states cross the stages
    ("mixtral", "default", "ep2_cp2", PASS),  # experts over ep x ep_shard inside dp_cp
    ("dbrx", "default", "ep2", PASS),  # experts' weights as flat [E*F, H] rows in a child module
    ("gemma4_text", "default", "pp2", PASS),  # per-layer inputs: the first stage hands them over
    ("gemma3n_text", "default", "pp2_ac", PASS),  # + keys/values shared across layers, 4 stages with AC
    ("zamba", "default", "pp2", PASS),  # every hybrid layer reads the input embeddings
]


@functools.cache
def _reference(model_type: str, variant: str, tmp: str) -> list[dict[str, float]]:
    ref, _ = run_case(
        recipe_config(tiny_model_config(model_type, variant), {"strategy": "fsdp2"}, f"{tmp}/ref"), 1
    )
    return ref


@pytest.mark.parametrize(("model_type", "variant", "layout", "expected"), CASES, ids=lambda v: str(v))
def test_conformance_case(
    model_type: str, variant: str, layout: str, expected: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_config = tiny_model_config(model_type, variant)
    ranks, distributed = LAYOUTS[layout]
    out = tmp_path_factory.mktemp(f"{model_type}-{variant}-{layout}")
    raw = recipe_config(model_config, distributed, str(out / "run"))
    if expected != PASS:
        with pytest.raises(Refused, match=expected):
            run_case(raw, ranks)
        return
    got, reports = run_case(raw, ranks)
    ref = _reference(model_type, variant, str(tmp_path_factory.mktemp(f"{model_type}-{variant}-ref")))
    rel = max_relative_difference(got, ref)
    assert rel <= RTOL, f"{model_type}/{variant}/{layout}: max relative difference {rel:.2e}\n{got}\n{ref}"
    num_layers, experts, _ = _model_facts(model_config)
    check_applied(layout, reports, num_layers=num_layers, num_experts=experts)


@pytest.mark.parametrize(
    "layout",
    ["fsdp2", "tp2_sp", "pp2", "cp2", "ep2", "tp2_pp2", "tp2_sp_pp2", "cp2_pp2", "ep2_pp2", "ep2_cp2"],
)
def test_layout_checks_reject_a_run_with_the_parallelism_off(
    layout: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One process's report, standing in for every rank of `layout`, fails its check: a layout
    whose parallelism was silently off cannot pass on parity alone."""
    model_type = "qwen3_moe" if "ep2" in layout else "llama"
    model_config = tiny_model_config(model_type)
    out = tmp_path_factory.mktemp(f"off-{layout}")
    _, (single,) = run_case(recipe_config(model_config, {"strategy": "fsdp2"}, str(out / "run")), 1)
    ranks, _ = LAYOUTS[layout]
    stand_ins = [
        {**single, "rank": r, "coordinates": {**single["coordinates"], "pp": r % 2}} for r in range(ranks)
    ]
    num_layers, experts, _ = _model_facts(model_config)
    with pytest.raises(AssertionError):
        check_applied(layout, stand_ins, num_layers=num_layers, num_experts=experts)
