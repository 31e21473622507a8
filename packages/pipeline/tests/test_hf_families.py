"""Stages run the model's own forward: families whose math differs from Llama's, pp2 vs one process.

Each case switches on what a re-implemented Llama stage forward would drop (embedding scale,
multipliers, logit scaling and soft-capping, sliding-window layers, learned positions, an
embedding norm, projections around the layers, tuple-returning layers, tied embeddings, a tie
inside a module with other weights), and
compares fp32 loss and every gradient with one process over two SGD steps. The test also checks
what each rank holds, so it fails if the split did not happen.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import AutoPipeline, PipelineConfig
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from hf_testlib import BATCH, VOCAB, loss_of, one_process, pipelined_steps  # noqa: E402

MICRO, LAYERS, LR, STEPS = 2, 4, 0.5, 2
SMALL = {
    "num_hidden_layers": LAYERS,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64,
}

CASES: dict[str, dict] = {
    "granite_multipliers": {
        "model_type": "granite",
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.3,
        "logits_scaling": 2.0,
        "tie_word_embeddings": False,
    },
    "cohere_logit_scale_tied": {"model_type": "cohere", "logit_scale": 0.5, "tie_word_embeddings": True},
    "gemma3_sliding_softcap_tied": {
        "model_type": "gemma3_text",
        "sliding_window": 4,
        "final_logit_softcapping": 3.0,
        "tie_word_embeddings": True,
    },
    "llama_tied": {"model_type": "llama", "tie_word_embeddings": True},
    "opt_projections": {
        "model_type": "opt",
        "ffn_dim": 64,
        "word_embed_proj_dim": 16,
        "tie_word_embeddings": False,
    },
    "gpt2_learned_positions_tied": {"model_type": "gpt2", "n_embd": 32, "n_layer": LAYERS, "n_head": 4},
    "bloom_tuple_layers_tied": {"model_type": "bloom", "n_layer": LAYERS, "n_head": 4},
    # The head's decoder is tied to the word embeddings inside bert.embeddings (with positions and
    # a norm), and its bias to cls.predictions.bias: ranks once disagreed on the tied set and hung.
    "bert_tied_inside_embeddings": {"model_type": "bert", "is_decoder": True},
    # The sinusoidal position table (a frozen nn.Embedding run once before the layers) is read by
    # every layer besides the hidden states: each stage runs it (a NaN stand-in made the loss NaN).
    "roformer_positions_read_by_every_layer": {"model_type": "roformer", "is_decoder": True},
}


def build(case: str) -> torch.nn.Module:
    options = dict(CASES[case])
    config = AutoConfig.for_model(options.pop("model_type"))
    for key, value in {**SMALL, **options}.items():
        if hasattr(config, key) or key in options:
            setattr(config, key, value)
    for key, value in config.to_dict().items():  # dropout would make the runs differ by RNG
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    config._attn_implementation = (
        "eager" if config.model_type in ("gemma3_text", "bloom", "roformer") else "sdpa"
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def reference(case: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    return one_process(build(case), lr=LR, steps=STEPS)


def pipelined(case: str) -> dict:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    tokens = [0]
    pipe = AutoPipeline(
        mesh=mesh, config=PipelineConfig(pp_batch_size=BATCH, pp_microbatch_size=MICRO)
    ).build(build(case), loss_fn=lambda logits, labels: loss_of(logits, labels, tokens[0]))
    out = pipelined_steps(pipe, tokens, lr=LR, steps=STEPS)
    dist.barrier()
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_pp2_equals_one_process(case: str) -> None:
    ref_losses, ref_grads = reference(case)
    ranks = run_on_ranks(pipelined, world_size=2, args=(case,), timeout_s=240)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(ref_losses, rel=1e-5), (rank["losses"], ref_losses)
    held = [set(r["held"]) for r in ranks]
    layer_names = [
        {m.group(1) for n in h if (m := re.search(r"\.(?:layers|layer|h)\.(\d+)\.", n))} for h in held
    ]
    assert held[0] != held[1] and all(layer_names), f"each stage holds its own layers: {layer_names}"
    everything = {n for n, _ in build(case).named_parameters()}
    assert held[0] | held[1] == everything, everything ^ (held[0] | held[1])
    shared = held[0] & held[1]
    assert shared == set(ranks[0]["tied"]) == set(ranks[1]["tied"]), shared  # only tied weights on both
    for step in range(STEPS):
        for rank in ranks:
            assert set(rank["grads"][step]) <= set(ref_grads[step]), "a frozen weight got a gradient"
            for name, grad in rank["grads"][step].items():
                torch.testing.assert_close(
                    grad, ref_grads[step][name], rtol=1e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}"
                )


def test_a_layer_looping_over_the_experts_that_got_tokens_is_traced() -> None:
    """DBRX's expert loop iterates over ``nonzero`` of the routing mask, which has no shape on fake
    tensors; the trace takes "nothing routed" and still finds what runs around the layers."""
    from automodel.pipeline.hf_structure import trace_hf_structure

    config = AutoConfig.for_model(
        "dbrx",
        d_model=64,
        n_heads=4,
        n_layers=4,
        vocab_size=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2, "hidden_size": 64},
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    structure = trace_hf_structure(model)
    assert (structure.layers_fqn, structure.num_layers) == ("transformer.blocks", 4)
    assert structure.pre_fqns == ("transformer.wte",)
    assert set(structure.post_fqns) == {"transformer.norm_f", "lm_head"}
