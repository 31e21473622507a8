"""Values a stage boundary carries besides the hidden states: Gemma-4's per-layer inputs and its
key/value states shared across layers, pp2 vs one process.

Gemma 4's layers each read a slice of per-layer inputs the model computes before the layers from
the token ids (``embed_tokens_per_layer``) and the input embeddings (``per_layer_model_projection``
and a norm); with ``num_kv_shared_layers`` the last layers reuse the keys and values earlier layers
stored in a mapping handed to every layer. A later stage has neither, so the first stage sends
them with the hidden states. Each case compares fp32 loss and every gradient with one process over
two SGD steps, checks what each rank holds, and that the carried tensors crossed the boundary:
the gradients of ``embed_tokens_per_layer``'s columns for the later stages' layers (nothing else
reads them) can only arrive through the carried values' backward.

The one-process reference runs the same micro-batches (gradients accumulated): Gemma 4 amplifies
rounding, so a whole-batch reference differs from a micro-batched one by 7e-6 in the second step's
gradients already (3e-7 in the first), more than the tolerance shows of the pipeline itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import AutoPipeline, PipelineConfig, validate_hf_model_for_pipeline_support
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from hf_testlib import BATCH, SEQ, VOCAB, batch, loss_of, one_process, pipelined_steps  # noqa: E402

MICRO, LAYERS, PER_LAYER, LR, STEPS = 2, 4, 8, 0.1, 2

CASES: dict[str, dict] = {
    # per-layer inputs: two pre-layer outputs carried (the token part, the projected embeddings)
    "per_layer_inputs": {"num_kv_shared_layers": 0, "schedule": "1f1b"},
    # + layers 2, 3 reuse the keys/values layers 0, 1 store: mapping entries carried too; four
    # stages on two ranks, so a stage also passes on what it received
    "kv_shared_interleaved": {"num_kv_shared_layers": 2, "schedule": "interleaved1f1b"},
    # a V: the middle stages on one rank, backward split into input and weight gradients
    "kv_shared_zbv": {"num_kv_shared_layers": 2, "schedule": "zbv"},
}


def build(case: str) -> torch.nn.Module:
    config = AutoConfig.for_model(
        "gemma4_text",
        num_hidden_layers=LAYERS,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        global_head_dim=16,
        vocab_size=VOCAB,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=PER_LAYER,
        max_position_embeddings=64,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        sliding_window=4,
        num_kv_shared_layers=CASES[case]["num_kv_shared_layers"],
        tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def reference(case: str) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    return one_process(build(case), lr=LR, steps=STEPS, micro=MICRO)


def pipelined(case: str) -> dict:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    tokens = [0]
    config = PipelineConfig(
        pp_schedule=CASES[case]["schedule"], pp_batch_size=BATCH, pp_microbatch_size=MICRO
    )
    pipe = AutoPipeline(mesh=mesh, config=config).build(
        build(case), loss_fn=lambda logits, labels: loss_of(logits, labels, tokens[0])
    )
    sent: dict[int, list] = {}
    got: dict[int, list] = {}

    def record(stage: int, args: tuple, output: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        got.setdefault(stage, [tuple(a.shape) for a in args])
        sent.setdefault(stage, [tuple(t.shape) for t in (output if isinstance(output, tuple) else (output,))])

    for part in pipe.model_parts:
        part.register_forward_hook(lambda m, args, output, i=part.stage_index: record(i, args, output))
    out = pipelined_steps(pipe, tokens, lr=LR, steps=STEPS)
    out["layers"] = {p.stage_index: list(p.layer_range) for p in pipe.model_parts}
    out["sent"], out["got"] = sent, got
    dist.barrier()
    return out


def test_the_trace_finds_what_crosses_the_boundary() -> None:
    with torch.device("meta"):
        structure = validate_hf_model_for_pipeline_support(build("kv_shared_interleaved"))
    assert structure.carried_pre_fqns == ("model.embed_tokens_per_layer", "model.per_layer_projection_norm")
    assert structure.shared_pre_fqns == ()
    # layer 0 stores the sliding-window layers' keys/values, layer 1 the full-attention ones
    assert [[e.key for e in structure.entries_at(b)] for b in range(LAYERS)] == [
        [],
        ["sliding_attention"],
        ["sliding_attention", "full_attention"],
        ["sliding_attention", "full_attention"],
    ]


@pytest.mark.parametrize("case", sorted(CASES))
def test_pp2_with_carried_values_equals_one_process(case: str) -> None:
    ref_losses, ref_grads = reference(case)
    ranks = run_on_ranks(pipelined, world_size=2, args=(case,), timeout_s=240)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(ref_losses, rel=1e-6), (rank["losses"], ref_losses)
    layers = {s: held for r in ranks for s, held in r["layers"].items()}
    assert sorted(i for held in layers.values() for i in held) == list(range(LAYERS))
    held = [set(r["held"]) for r in ranks]
    everything = {n for n, _ in build(case).named_parameters()}
    assert held[0] | held[1] == everything, everything ^ (held[0] | held[1])
    # the modules making the per-layer inputs are the first stage's alone
    assert all(
        n not in held[1] for n in everything if "per_layer_model" in n or "embed_tokens_per_layer" in n
    )
    # only the tied embedding is on both ranks (in a V, rank 0 holds both ends: both copies)
    assert held[0] & held[1] <= set(ranks[0]["tied"]) == {"model.embed_tokens.weight"}
    # what crossed: (hidden, per-layer token part, per-layer projection[, keys/values]) each boundary
    hidden, token_part, projection = (
        (MICRO, SEQ, 32),
        (MICRO, SEQ, LAYERS * PER_LAYER),
        (MICRO, SEQ, LAYERS, PER_LAYER),
    )
    sent = {s: shapes for r in ranks for s, shapes in r["sent"].items()}
    got = {s: shapes for r in ranks for s, shapes in r["got"].items()}
    last = max(sent)
    for stage in range(last):
        assert sent[stage][:3] == [hidden, token_part, projection], sent[stage]
        assert got[stage + 1] == sent[stage], (got[stage + 1], sent[stage])
    if CASES[case]["num_kv_shared_layers"]:
        assert len(sent[1]) == 3 + 4, sent[1]  # + (k, v) of the sliding and the full-attention layers
    for step in range(STEPS):
        atol = 1e-6 if step == 0 else 5e-6  # the second step's parameters differ by the first's rounding
        for rank in ranks:
            assert set(rank["grads"][step]) <= set(ref_grads[step])
            for name, grad in rank["grads"][step].items():
                torch.testing.assert_close(
                    grad, ref_grads[step][name], rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
                )
        table = ranks[0]["grads"][step]["model.embed_tokens_per_layer.weight"]
        later = table[:, layers[last][0] * PER_LAYER :]  # columns only the later stages' layers read
        assert later.abs().sum() > 0


def test_stage_output_shapes_on_meta_inputs_are_the_real_ones() -> None:
    """torch < 2.13 infers stage shapes from meta inputs: a stage carrying more than hidden states
    learns its outputs' shapes by running once on placeholder data, so they equal a real forward's."""
    from automodel.pipeline.hf import hf_module_fqns_per_stage, make_causal_lm_stage
    from automodel.pipeline.split import split_module

    model = build("kv_shared_interleaved")
    structure = validate_hf_model_for_pipeline_support(model)
    fqns = hf_module_fqns_per_stage(model, num_stages=2, structure=structure)
    first, second = (
        make_causal_lm_stage(
            split_module(model, fqns=fqns[s]), model=model, structure=structure, stage_index=s, num_stages=2
        )
        for s in range(2)
    )
    ids = batch(0)[0][:MICRO]
    with torch.no_grad():
        sent = first(ids)
        logits = second(*sent, token_ids=ids)
        meta_sent = first(ids.to("meta"))
        meta_logits = second(*(t.to("meta") for t in sent), token_ids=ids.to("meta"))
    assert [t.shape for t in meta_sent] == [t.shape for t in sent] and all(t.is_meta for t in meta_sent)
    assert len(sent) == 3 + 4  # hidden, two per-layer input parts, (k, v) of two attention kinds
    assert meta_logits.shape == logits.shape == (MICRO, SEQ, VOCAB)
