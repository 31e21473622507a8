"""TP plan resolution and the clear errors of bad TP input."""

from __future__ import annotations

import pytest
import torch
from fsdp2_testlib import tiny_model
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from automodel.fsdp2 import get_hf_tp_shard_plan, resolve_tp_plan, translate_to_torch_parallel_style
from automodel.fsdp2.tp_plan import validate_tp_mesh
from automodel.fsdp2.tp_shared_styles import RowwiseOwnedOutput, SharedTailParallel
from automodel.testing.ranks import RankFailure, run_on_ranks

#: A plan importable by path (resolve_tp_plan accepts "module.attr" strings).
CUSTOM_PLAN = {"model.layers.*.mlp.down_proj": "rowwise", "model.layers.*.mlp.up_proj": "colwise"}


def custom_plan_fn() -> dict:
    return dict(CUSTOM_PLAN)


_IN_SHARD = (Shard(-1),)
_REP = (Replicate(),)


@pytest.mark.parametrize(
    ("style", "cls", "inputs", "outputs"),
    [
        ("colwise", ColwiseParallel, _REP, _IN_SHARD),
        ("rowwise", RowwiseOwnedOutput, _IN_SHARD, _REP),
        ("colwise_rep", ColwiseParallel, _REP, _REP),
        ("colwise_gather_output", ColwiseParallel, _REP, _REP),
        ("rowwise_rep", RowwiseParallel, _REP, _REP),
        ("rowwise_split_input", RowwiseParallel, _REP, _REP),
        ("embedding_rowwise", RowwiseParallel, _REP, _REP),
        ("embedding_colwise", ColwiseParallel, _REP, _REP),
        ("sequence_parallel", SequenceParallel, None, None),
        ("replicated_with_grad_allreduce", SequenceParallel, None, None),
        ("local_colwise", ColwiseParallel, _REP, _IN_SHARD),
        ("local_rowwise", RowwiseOwnedOutput, _IN_SHARD, _REP),
    ],
)
def test_every_supported_style_translates(
    style: str, cls: type, inputs: tuple | None, outputs: tuple | None
) -> None:
    """Each HF style string becomes the torch style (and input/output layouts) that shards like it."""
    translated = translate_to_torch_parallel_style(style)
    assert type(translated) is cls
    assert getattr(translated, "input_layouts", None) == inputs
    assert getattr(translated, "output_layouts", None) == outputs


def test_style_semantics() -> None:
    gather = translate_to_torch_parallel_style("colwise_gather_output")
    assert isinstance(gather, ColwiseParallel) and gather.output_layouts == (Replicate(),)
    emb = translate_to_torch_parallel_style("embedding_rowwise")
    assert isinstance(emb, RowwiseParallel) and emb.input_layouts == (Replicate(),)


def test_unknown_and_unsupported_styles_raise() -> None:
    with pytest.raises(ValueError, match="unknown tensor-parallel style 'diagonal'"):
        translate_to_torch_parallel_style("diagonal")
    with pytest.raises(ValueError, match="'moe_tp_experts'.*automodel.moe"):
        translate_to_torch_parallel_style("moe_tp_experts")


def test_hf_plan_of_llama_uses_transformers5_styles() -> None:
    plan = get_hf_tp_shard_plan(tiny_model())
    assert isinstance(plan["lm_head"], ColwiseParallel) and plan["lm_head"].output_layouts == (Replicate(),)
    assert isinstance(plan["model.embed_tokens"], RowwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], RowwiseParallel)


def test_hf_plan_of_qwen3_replicates_qk_norms() -> None:
    plan = get_hf_tp_shard_plan(tiny_model(family="qwen3"))
    assert type(plan["model.layers.*.self_attn.q_norm"]) is SequenceParallel


def test_hf_plan_of_a_moe_model_keeps_attention_and_skips_what_the_instance_lacks() -> None:
    """Qwen3-MoE's HF plan also names dense `mlp.*_proj` (for `mlp_only_layers`) and expert styles."""
    model = tiny_model(family="qwen3_moe")
    plan = get_hf_tp_shard_plan(model)
    assert isinstance(plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["model.layers.*.self_attn.o_proj"], RowwiseParallel)
    assert not any(".mlp." in key for key in plan), sorted(plan)  # experts stay with automodel.moe
    with pytest.raises(ValueError, match="sequence_parallel is not supported for MoE decoder layers"):
        resolve_tp_plan(model, sequence_parallel=True)


def test_resolution_order() -> None:
    model = tiny_model()
    explicit = resolve_tp_plan(model, tp_plan={"lm_head": "colwise_rep"})
    assert list(explicit) == ["lm_head"]
    by_path = resolve_tp_plan(model, tp_plan=f"{__name__}.CUSTOM_PLAN")
    assert set(by_path) == set(CUSTOM_PLAN)
    by_fn = resolve_tp_plan(model, tp_plan=f"{__name__}.custom_plan_fn")
    assert set(by_fn) == set(CUSTOM_PLAN)
    assert set(resolve_tp_plan(model)) == set(get_hf_tp_shard_plan(model))
    sp = resolve_tp_plan(model, sequence_parallel=True)
    assert type(sp["model.norm"]) is SequenceParallel and "model.layers.*.input_layernorm" in sp


def test_model_without_hf_plan_needs_an_explicit_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model declaring no TP plan may hard-code its head count (StableLM does): the automatic
    plans refuse it by name; an explicit plan is the user's statement that it works."""
    model = tiny_model()
    monkeypatch.setattr(type(model.config), "base_model_tp_plan", None)  # its config class declares none
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        resolve_tp_plan(model)
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        resolve_tp_plan(model, sequence_parallel=True)
    plan = resolve_tp_plan(model, tp_plan={"model.layers.*.mlp.gate_proj": "colwise"})
    assert list(plan) == ["model.layers.*.mlp.gate_proj"]


def test_validate_tp_mesh_names_heads() -> None:
    model = tiny_model()  # 4 heads, 2 KV heads
    validate_tp_mesh(model, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tp_size=4"):
        validate_tp_mesh(model, 4)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tp_size=3"):
        validate_tp_mesh(model, 3)


def _bad_input_on_ranks(case: str) -> str:
    from automodel.fsdp2 import DDPConfig, DDPManager, apply_tp
    from automodel.mesh import MeshContext, ParallelismSizes

    if case == "ddp_tp":
        mesh = MeshContext.build(ParallelismSizes(tp_size=2))
        DDPManager(DDPConfig(backend="gloo"), mesh)
    tp_mesh = MeshContext.build(ParallelismSizes(tp_size=4 if case == "tp_heads" else 2)).get_mesh("tp")
    model = tiny_model()
    plan = {
        "tp_heads": None,
        "unknown_style": {"lm_head": "zigzag"},
        "missing_key": {"model.layers.*.mlp.gate_projection": "colwise"},
    }[case]
    apply_tp(model, tp_mesh=tp_mesh, tp_plan=plan)
    return "no error"


@pytest.mark.parametrize(
    ("case", "world", "message"),
    [
        ("tp_heads", 4, "num_key_value_heads=2 is not divisible by tp_size=4"),
        ("unknown_style", 2, "unknown tensor-parallel style 'zigzag'"),
        ("missing_key", 2, r"keys \['model.layers.\*.mlp.gate_projection'\] match no submodule"),
        ("ddp_tp", 2, "strategy 'ddp' supports data parallelism only; got tp_size=2"),
    ],
)
def test_bad_input_is_a_clear_error(case: str, world: int, message: str) -> None:
    with pytest.raises(RankFailure, match=message):
        run_on_ranks(_bad_input_on_ranks, world_size=world, args=(case,), timeout_s=300)


def _meta_model(model_type: str, **sizes: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, num_hidden_layers=2, vocab_size=64, **sizes)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_hf_plan_of_latent_attention_sums_the_shared_rope_key_grad() -> None:
    """MLA's kv_a_proj_with_mqa ([latent | rope key]) stays whole; its rope key, used by every rank's
    heads, has its gradient summed over tp (left alone it was a partial sum: tp2 was 3e-4 off)."""
    model = _meta_model(
        "minicpm3", hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, intermediate_size=64,
    )  # fmt: skip
    style = get_hf_tp_shard_plan(model)["model.layers.*.self_attn.kv_a_proj_with_mqa"]
    assert isinstance(style, SharedTailParallel) and style.width == 8


def test_hf_plan_of_a_learned_activation_replicates_it_with_grad_allreduce() -> None:
    """Apertus' xIELU has learned scalars applied to the colwise-sharded MLP activation."""
    model = _meta_model(
        "apertus", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64
    )
    plan = get_hf_tp_shard_plan(model)
    style = plan["model.layers.*.mlp.act_fn"]
    assert type(style) is SequenceParallel and style.sequence_sharding == (Shard(-1),)
    assert not any(k.endswith("act_fn") for k in get_hf_tp_shard_plan(tiny_model()))  # SiLU: no parameters


def _shared_tail_on_ranks() -> list[float]:
    """y = W x; rank r uses y's last 2 features scaled by (r + 1) and its first 2 features whole,
    as MLA's heads do: W's gradient must be the one-process gradient of the summed use."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    lin, x = torch.nn.Linear(3, 4, bias=False), torch.randn(5, 3)
    parallelize_module(lin, init_device_mesh("cpu", (2,)), SharedTailParallel(2))
    rank = dist.get_rank()
    y = lin(x)
    (y[:, :2].sum() + (rank + 1) * y[:, 2:].sum()).backward()
    return lin.weight.grad.flatten().tolist()


def test_shared_tail_parallel_sums_only_the_tail_gradient() -> None:
    results = run_on_ranks(_shared_tail_on_ranks, world_size=2, timeout_s=120)
    torch.manual_seed(0)
    torch.nn.Linear(3, 4, bias=False)  # same random stream as the ranks
    x = torch.randn(5, 3)
    expected = torch.cat([x.sum(0).expand(2, 3), 3 * x.sum(0).expand(2, 3)]).flatten()
    for got in results:
        torch.testing.assert_close(torch.tensor(got), expected)


def test_sequence_parallel_refuses_container_held_parameters() -> None:
    """A weight a container holds itself (HRM's z_L_init) would meet sequence shards as a whole tensor."""

    class Base(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(8, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4)])
            self.z_init = nn.Parameter(torch.zeros(4))

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Base()

    with pytest.raises(ValueError, match=r"sequence parallel: .*\['model.z_init'\]"):
        from automodel.fsdp2.tp_checks import check_sequence_parallel_applies

        check_sequence_parallel_applies(Wrapper())


def test_plan_keys_of_modules_another_pipeline_stage_holds_are_not_typos() -> None:
    """A stage before the last holds lm_head and the final norm as None: an explicit plan naming
    them is the whole model's plan (checked before launch), not a typo; a real typo still fails."""
    from automodel.fsdp2.tp_plan import check_plan_matches_model, explicit_plan

    stage = _meta_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    stage.lm_head, stage.get_submodule("model").norm = None, None
    plan = explicit_plan({"model.layers.*.self_attn.q_proj": "colwise", "lm_head": "colwise_gather_output"})
    check_plan_matches_model(stage, plan)
    with pytest.raises(ValueError, match=r"\['model.nrom'\] match no submodule"):
        check_plan_matches_model(stage, {**plan, **explicit_plan({"model.nrom": "sequence_parallel"})})


def test_plain_rowwise_on_an_embedding_is_refused_naming_embedding_rowwise() -> None:
    """Plain rowwise reads its input as split on the last dim: on token ids every rank embedded a
    sequence twice as long (Llama crashed in its rotary embedding); embedding_rowwise is right."""
    from automodel.fsdp2.tp_plan import check_plan_shards_every_layer, explicit_plan

    model = _meta_model("llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    layers = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
    check_plan_shards_every_layer(model, explicit_plan({**layers, "model.embed_tokens": "embedding_rowwise"}))
    with pytest.raises(ValueError, match="model.embed_tokens is an nn.Embedding.*use 'embedding_rowwise'"):
        check_plan_shards_every_layer(model, explicit_plan({**layers, "model.embed_tokens": "rowwise"}))
