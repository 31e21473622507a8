"""`recipes plan`: ranked layouts with memory and step-time estimates; bad input names the flag."""

from __future__ import annotations

import pytest

from automodel.recipes.cli import run_cli


def test_plan_8b_on_8_gpus_prints_table_breakdown_and_yaml(capsys: pytest.CaptureFixture) -> None:
    args = ["plan", "--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch", "128"]
    assert run_cli(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "8.03 B parameters" in out
    assert "peak GiB" in out and "tok/s/GPU" in out
    assert "estimated per-rank peak" in out and "activations" in out and "logits" in out
    assert "distributed:\n  strategy: fsdp2" in out
    rows = [line.split() for line in out.splitlines() if line[:2].strip().isdigit()]
    peaks = [float(r[-4]) for r in rows]
    assert rows and all(p <= 80 * 0.9 for p in peaks)  # only layouts that fit are listed


def test_smaller_gpu_memory_drops_layouts(capsys: pytest.CaptureFixture) -> None:
    base = ["plan", "--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "8192", "--top", "50"]
    assert run_cli(base) == 0
    big = sum(1 for line in capsys.readouterr().out.splitlines() if line[:2].strip().isdigit())
    assert run_cli([*base, "--gpu-memory", "24GiB"]) == 0
    small = sum(1 for line in capsys.readouterr().out.splitlines() if line[:2].strip().isdigit())
    assert 0 < small < big


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--model", "no/such-model", "--gpus", "8", "--seq-len", "4096"], "--model='no/such-model'"),
        (["--model", "llama3.1-8b", "--gpus", "0", "--seq-len", "4096"], "--gpus=0"),
        (
            ["--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "4096", "--gpu-memory", "lots"],
            "--gpu-memory='lots'",
        ),
        (["--model", "llama3.1-8b", "--gpus", "12", "--seq-len", "4096"], "--gpus=12"),
        (["--model", "llama3.1-8b", "--gpus", "8", "--seq-len", "4096", "--peft", "qlora"], "--peft='qlora'"),
        (["--model", "llama3.1-8b", "--gpus", "1", "--seq-len", "8192", "--gpu-memory", "8GiB"], "--gpus=1"),
        (
            ["--model", "qwen3-30b-a3b", "--gpus", "8", "--seq-len", "4096", "--moe-load-factor", "0.5"],
            "--moe-load-factor=0.5",
        ),
    ],
)
def test_bad_input_names_the_flag(args: list[str], key: str, capsys: pytest.CaptureFixture) -> None:
    assert run_cli(["plan", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0], err


def test_moe_load_factor_raises_only_the_busiest_ep_ranks_share() -> None:
    """Imbalanced routing: the busiest EP rank holds and computes `load` times its share of the
    routed slots; without EP every rank computes all of its own tokens' slots (no change)."""
    from dataclasses import replace

    from automodel.recipes.planning.memory import StepSetup, estimate_step_memory
    from automodel.recipes.planning.models import resolve_model_config
    from automodel.recipes.planning.roofline import Hardware, estimate_step_time
    from automodel.recipes.planning.shape import model_shape
    from automodel.recipes.planning.step import sized

    shape = model_shape(resolve_model_config("qwen3-30b-a3b"))
    hw = Hardware()
    for ep, grows in ((1, False), (8, True)):
        base = StepSetup(sizes=sized(ep=ep, dp_shard=8), seq_len=4096, compute_bytes=2, reduce_bytes=4)
        heavy = replace(base, expert_load_factor=1.5)
        mem0, mem1 = estimate_step_memory(shape, base), estimate_step_memory(shape, heavy)
        t0, t1 = (estimate_step_time(shape, s, hw, world=8).seconds for s in (base, heavy))
        assert (mem1.activation_bytes > mem0.activation_bytes) is grows, ep
        assert (t1 > t0) is grows, ep
    # the factor is capped at ep: one rank cannot receive more than every slot
    capped = StepSetup(sizes=sized(ep=2, dp_shard=2), seq_len=4096, expert_load_factor=2.0)
    over = replace(capped, expert_load_factor=7.0)
    assert estimate_step_memory(shape, over).peak_bytes == estimate_step_memory(shape, capped).peak_bytes
    with pytest.raises(ValueError, match="expert_load_factor must be >= 1"):
        StepSetup(sizes=sized(ep=2, dp_shard=2), expert_load_factor=0.9)


def test_ep_layouts_try_freeing_gathered_weights_after_forward(capsys: pytest.CaptureFixture) -> None:
    """With EP the recipes keep every layer's gathered weights from forward to backward unless
    `moe.reshard_after_forward: true`; the planner tries both (True: less memory, a second gather),
    and the one it ranks first for Qwen3-30B-A3B on 8 H100 is expert parallel with FSDP over 8 ranks,
    as NeMo AutoModel's published DGX-H100 layout (EP8, FSDP 8), and the YAML says which it chose."""
    from dataclasses import replace

    from automodel.recipes.planning.memory import StepSetup, estimate_step_memory
    from automodel.recipes.planning.models import resolve_model_config
    from automodel.recipes.planning.roofline import Hardware, estimate_step_time
    from automodel.recipes.planning.shape import model_shape
    from automodel.recipes.planning.step import sized

    shape = model_shape(resolve_model_config("qwen3-30b-a3b"))
    kept = StepSetup(
        sizes=sized(ep=8, dp_shard=8), seq_len=4096, compute_bytes=2, reduce_bytes=4, grad_accum=64,
        activation_checkpointing=True, reshard_after_forward=False,
    )  # fmt: skip
    freed = replace(kept, reshard_after_forward=True)
    assert estimate_step_memory(shape, freed).peak_bytes < estimate_step_memory(shape, kept).peak_bytes
    fsdp_s = [estimate_step_time(shape, s, Hardware(), world=8).fsdp_s for s in (kept, freed)]
    assert fsdp_s[1] > fsdp_s[0]  # the second gather costs traffic

    args = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--seq-len", "4096", "--global-batch", "512"]
    assert run_cli(args) == 0
    out = capsys.readouterr().out
    best = next(line.split() for line in out.splitlines() if line[:2].strip() == "1")
    tp, pp, cp, ep, dp_shard = (int(v) for v in best[1:6])
    assert (tp, pp, ep > 1, dp_shard * cp) == (1, 1, True, 8), best
    assert "  moe: {reshard_after_forward: true}" in out


@pytest.mark.parametrize(
    ("model_type", "config", "moe"),
    [
        ("gpt2", {"n_layer": 3, "n_embd": 32, "n_head": 4, "vocab_size": 128}, False),  # transformer.h
        (
            "dbrx",  # transformer.blocks; experts as flat [E*F, H] rows; top-k in ffn_config
            {
                "n_layers": 3,
                "d_model": 32,
                "n_heads": 4,
                "vocab_size": 128,
                "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
                "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
            },
            True,
        ),  # fmt: skip
    ],
)
def test_model_shape_finds_layers_and_experts_by_structure(model_type: str, config: dict, moe: bool) -> None:
    """Parameter counts per decoder layer come from the layer list the pipeline split finds (not
    from a `layers.N.` name), so models with other names get real per-layer sizes, and routed
    experts are those expert parallelism splits."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.recipes.planning.shape import model_shape

    hf_config = AutoConfig.for_model(model_type, **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    shape = model_shape(hf_config, model=model)
    assert shape.layers == 3 and shape.layer_dense_params > 0
    assert shape.total_params == sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    assert shape.embed_params == embedding
    if moe:
        assert (shape.experts, shape.top_k, shape.moe_layers) == (4, 2, 3)
        assert shape.layer_expert_params == 3 * 4 * 16 * 32  # w1, v1, w2: [E*F, H] each
    else:
        assert shape.layer_expert_params == 0
