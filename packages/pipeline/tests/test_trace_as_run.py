"""The split's meta-tensor trace runs the model as training runs it: its own attention
implementation, called as a stage calls it (position ids, no attention mask), so a model that
trains in one process splits.

DeepSeek-V3 with fewer key/value heads (2) than attention heads (4) trains in one process with sdpa:
transformers hands sdpa no mask and native GQA, and the latent attention's keys already have a head
per query head. The trace once switched every model to eager attention and passed a padding mask;
transformers then repeated the key heads (4 -> 8) and the split was refused ("The size of tensor a
(4) must match the size of tensor b (8)"). Here it splits and pp2 equals one process.
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
from automodel.pipeline.hf_values import KnownValues
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from hf_testlib import BATCH, VOCAB, loss_of, one_process, pipelined_steps  # noqa: E402

MICRO, LR, STEPS = 2, 0.5, 2
#: a tiny DeepSeek-V3: latent attention with 2 key/value heads under 4 attention heads, the first
#: layer dense and the others mixture-of-experts (4 routed experts, top 2, one shared)
DEEPSEEK_V3 = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": None,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,  # = qk_nope + qk_rope: transformers gives sdpa native GQA only then
    "max_position_embeddings": 64,
}


def deepseek_v3(attn: str = "sdpa") -> torch.nn.Module:
    config = AutoConfig.for_model("deepseek_v3", **DEEPSEEK_V3)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).float()


def _pipelined() -> dict:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    tokens = [0]
    pipe = AutoPipeline(
        mesh=mesh, config=PipelineConfig(pp_schedule="1f1b", pp_batch_size=BATCH, pp_microbatch_size=MICRO)
    ).build(deepseek_v3(), loss_fn=lambda logits, labels: loss_of(logits, labels, tokens[0]))
    out = pipelined_steps(pipe, tokens, lr=LR, steps=STEPS)
    out["fqns"] = pipe.fqns_per_stage
    out["attn"] = {
        getattr(m.config, "_attn_implementation", None)
        for p in pipe.model_parts
        for m in p.modules()
        if hasattr(m, "config")
    }
    dist.barrier()
    return out


def test_deepseek_v3_with_fewer_kv_heads_splits_and_pp2_equals_one_process() -> None:
    model = deepseek_v3()
    structure = validate_hf_model_for_pipeline_support(model)  # refused before the fix
    assert (structure.layers_fqn, structure.num_layers) == ("model.layers", 4)
    assert structure.pre_fqns == ("model.embed_tokens",)
    assert set(structure.post_fqns) == {"model.norm", "lm_head"}
    # the trace ran on a copy: the model is as built
    assert getattr(model.config, "_attn_implementation", None) == "sdpa"

    ref_losses, ref_grads = one_process(deepseek_v3(), lr=LR, steps=STEPS)
    ranks = run_on_ranks(_pipelined, world_size=2, timeout_s=300)
    for rank in ranks:
        assert rank["losses"] == pytest.approx(ref_losses, rel=1e-5)
        assert rank["attn"] == {"sdpa"}
    # stage 0: the embedding and the dense layer 0 with MoE layer 1; stage 1: MoE layers 2-3, norm, head
    fqns = ranks[0]["fqns"]
    assert [f for f in fqns[0] if "layers" in f] == ["model.layers.0", "model.layers.1"]
    assert [f for f in fqns[1] if "layers" in f] == ["model.layers.2", "model.layers.3"]
    assert "model.embed_tokens" in fqns[0] and {"model.norm", "lm_head"} <= set(fqns[1])
    held = [set(r["held"]) for r in ranks]
    assert not held[0] & held[1]
    assert held[0] | held[1] == {n for n, _ in deepseek_v3().named_parameters()}
    assert any(".mlp.experts." in n for n in held[1]) and any("layers.0.mlp.gate_proj" in n for n in held[0])
    for step in range(STEPS):
        seen = set()
        for rank in ranks:
            for name, grad in rank["grads"][step].items():
                torch.testing.assert_close(grad, ref_grads[step][name], rtol=1e-5, atol=2e-6, msg=name)
                seen.add(name)
        assert seen == set(ref_grads[step])


def test_known_values_answer_what_follows_from_the_inputs_only() -> None:
    """Position ids 0..n-1 are not packed (transformers' question, asked with `.item()`); a value
    that depends on an unknown (a weight) still cannot be read, as on plain meta tensors."""
    with torch.no_grad(), KnownValues():
        positions = torch.arange(16, device="meta").unsqueeze(0)
        diff = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
        packed = (diff != 1).cumsum(-1)
        assert bool((packed[:, -1] == 0).all())
        assert int(positions[0, 5]) == 5
        ones = torch.ones(16, device="meta")
        ones[3:].mul_(2)  # an in-place write through a view, mirrored on the known copy
        assert float(ones.sum()) == 29.0
        for unknown in (torch.randn(16, device="meta"), torch.empty(16, device="meta")):
            with pytest.raises(RuntimeError, match="meta"):
                bool((unknown + positions[0]).all())
        ones[:2].copy_(torch.randn(2, device="meta"))  # an unknown written into a view of it
        with pytest.raises(RuntimeError, match="meta"):
            float(ones.sum())
