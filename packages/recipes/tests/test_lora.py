"""LoRA (``peft:``): step 0 equals the base model, every layout equals one process (losses and
adapter gradients), each rank holds what the layout says (adapter placements, frozen base, an
optimizer over the adapters only), adapters load in Hugging Face peft, merged export, exact resume."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from automodel.testing.layout_table import layouts_named
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _lora_helpers import lora_train_on_rank, lora_train_then_logits  # noqa: E402
from _recipe_helpers import MOE_MODEL, RTOL, TINY, assert_losses_close, preload, tiny_config, train_on_rank  # noqa: E402

preload()

TIMEOUT = 300
PEFT = {"dim": 4, "alpha": 8}  # target_modules: NeMo's default "*_proj"


def _assert_grads_close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for name, r in ref.items():
        err = (got[name] - r).abs().max().item()
        assert err <= RTOL * r.abs().max().item(), f"{name}: max error {err} (max |grad| {r.abs().max()})"


# ---- configuration -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("peft", "key"),
    [
        ({"dim": 0}, "peft.dim"),
        ({"alpha": -1}, "peft.alpha"),
        ({"dropout": 1.5}, "peft.dropout"),
        ({"dropout_position": "middle"}, "peft.dropout_position"),
        ({"target_modules": ["*_proj"], "exclude_modules": ["lm_head"]}, "peft.exclude_modules"),
        ({"match_all_linear": True, "target_modules": "q_proj"}, "peft.match_all_linear"),
        ({"use_triton": "yes"}, "peft.use_triton"),  # true: accepted, a start-up line (compat.translate)
        ({"rank": 8}, "peft.rank"),
    ],
)
def test_bad_peft_section_names_the_key(peft: dict, key: str, tmp_path: Path) -> None:
    from automodel.recipes import load_config
    from automodel.recipes.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(tiny_config(str(tmp_path), peft=peft))


def _meta_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))


def test_target_selection_follows_nemo_semantics() -> None:
    from automodel.recipes.peft import PeftSection, select_linears

    model = _meta_model(TINY["model"]["config"])
    default = select_linears(model, PeftSection())  # "*_proj": every projection, not lm_head
    assert len(default) == 2 * 7 and "lm_head" not in default
    assert "lm_head" in select_linears(model, PeftSection(match_all_linear=True))
    assert select_linears(model, PeftSection(target_modules=["q_proj", "v_proj"])) == [
        f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")
    ]
    assert select_linears(model, PeftSection(target_modules="*.layers.1.*.o_proj")) == [
        "model.layers.1.self_attn.o_proj"
    ]
    no_mlp = select_linears(model, PeftSection(exclude_modules=["*.mlp.*", "lm_head"]))
    assert len(no_mlp) == 2 * 4 and all("self_attn" in n for n in no_mlp)


def test_moe_experts_cannot_be_targeted() -> None:
    from automodel.recipes.errors import ConfigError
    from automodel.recipes.peft import PeftSection, apply_lora

    model = _meta_model(MOE_MODEL["config"])
    for pattern in ("*.experts", "gate_up_proj"):
        with pytest.raises(ConfigError, match=r"peft\.target_modules.*stacked 3-D parameters"):
            apply_lora(model, section=PeftSection(target_modules=[pattern]))
    with pytest.raises(ConfigError, match=r"peft\.target_modules.*matches no nn\.Linear"):
        apply_lora(model, section=PeftSection(target_modules=["nothing_here"]))
    info = apply_lora(model, section=PeftSection())  # "*_proj": the attention projections only
    assert info.module_fqns == [f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo"]


def test_lora_a_init_reads_nemo_automodels_key() -> None:
    """``lora_A_init`` is NeMo AutoModel 0.7's key with its meaning: default ``xavier``, drawn with
    ``xavier_normal_`` (its ``LinearLoRA.init_lora_weights``); anything else kaiming-uniform(a=sqrt 5)."""
    import math

    from automodel.recipes.peft import PeftSection
    from automodel.recipes.peft.lora import init_adapter_A

    assert PeftSection().lora_A_init == "xavier"
    shape = (8, 64)  # [dim, in]
    uniform_bound = math.sqrt(6.0 / sum(shape))  # xavier_uniform_'s support: a normal draw exceeds it
    got = torch.empty(shape)
    init_adapter_A(got, method="xavier", generator=torch.Generator().manual_seed(3))
    ref = torch.empty(shape)
    torch.nn.init.xavier_normal_(ref, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, ref)
    assert got.abs().max().item() > uniform_bound
    assert abs(got.std().item() - math.sqrt(2.0 / sum(shape))) < 0.03
    for method in ("kaiming", "uniform"):
        init_adapter_A(got, method=method, generator=torch.Generator().manual_seed(3))
        torch.nn.init.kaiming_uniform_(ref, a=math.sqrt(5), generator=torch.Generator().manual_seed(3))
        assert torch.equal(got, ref)


def test_zero_b_gives_the_base_model_exactly() -> None:
    """B = 0 at initialisation: the wrapped model's logits are the base model's, bit for bit; the
    base weights are the same (frozen) Parameters and only the adapters require grad."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.recipes.peft import LoRALinear, PeftSection, apply_lora

    cfg = dict(TINY["model"]["config"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        base = model(input_ids=ids).logits
    q_weight = model.model.layers[0].self_attn.q_proj.weight
    apply_lora(model, section=PeftSection(match_all_linear=True, dim=4, alpha=8))
    wrapped = [m for m in model.modules() if isinstance(m, LoRALinear)]
    for m in wrapped:
        m.reset_adapters()
    assert model.model.layers[0].self_attn.q_proj.weight is q_weight
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if ".lora_" in n
    }
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, base)
        wrapped[0].lora_B.weight.fill_(0.1)
        assert not torch.allclose(model(input_ids=ids).logits, base)


# ---- every layout equals one process -------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("lora_ref")
    (ref,) = run_on_ranks(
        lora_train_on_rank, world_size=1, args=(tiny_config(str(out), peft=PEFT),), timeout_s=TIMEOUT
    )
    (full,) = run_on_ranks(
        train_on_rank, world_size=1, args=(tiny_config(str(out / "full")),), timeout_s=TIMEOUT
    )
    assert ref["losses"][0] == full[0]  # B = 0: step 1 is the base model's loss
    assert ref["losses"][2] < ref["losses"][0] and ref["losses"][1] != full[1], (ref["losses"], full)
    return ref


def _adapters_only(result: dict) -> None:
    """Only LoRA adapters train, and the optimizer holds exactly the trainable ones of this rank."""
    trainable = sorted(n for n, p in result["params"].items() if p["requires_grad"])
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    assert result["optimizer_params"] == trainable
    assert set(result["grads"]) == set(trainable)


def _placement(result: dict, name: str, axis: str) -> str | None:
    placements = result["params"][name]["placements"] or {}
    return placements.get(axis)


L0 = "model.layers.0"
#: The shared layouts (`automodel.testing.layout_table`) the adapters are checked under, the strategy named.
LAYOUTS = {
    layout.name: (layout.ranks, {"strategy": "fsdp2", **layout.distributed})
    for layout in layouts_named("fsdp2_dp2", "tp2", "tp2_sp", "pp2_1f1b", "hsdp_2x2", "ddp2", "cp2")
}


def _tp_layout(r: dict) -> bool:
    # colwise q_proj: W and B sharded on rows, A replicated; rowwise o_proj: W and A on columns, B replicated
    return (
        _placement(r, f"{L0}.self_attn.q_proj.weight", "tp") == "S(0)"
        and _placement(r, f"{L0}.self_attn.q_proj.lora_A.weight", "tp") == "R"
        and _placement(r, f"{L0}.self_attn.q_proj.lora_B.weight", "tp") == "S(0)"
        and _placement(r, f"{L0}.self_attn.o_proj.weight", "tp") == "S(1)"
        and _placement(r, f"{L0}.self_attn.o_proj.lora_A.weight", "tp") == "S(1)"
        and _placement(r, f"{L0}.self_attn.o_proj.lora_B.weight", "tp") == "R"
        and _placement(r, f"{L0}.mlp.down_proj.lora_A.weight", "tp") == "S(1)"
    )


APPLIED = {
    # frozen base and adapters sharded by FSDP2 alike
    "fsdp2_dp2": lambda r: (
        _placement(r, f"{L0}.self_attn.q_proj.weight", "dp_shard_cp") == "S(0)"
        and _placement(r, f"{L0}.self_attn.q_proj.lora_A.weight", "dp_shard_cp") == "S(0)"
        and _placement(r, f"{L0}.self_attn.q_proj.lora_B.weight", "dp_shard_cp") == "S(0)"
    ),
    "tp2": _tp_layout,
    "tp2_sp": lambda r: _tp_layout(r) and _placement(r, f"{L0}.input_layernorm.weight", "tp") == "R",
    # each stage holds its own layer, adapters included
    "pp2_1f1b": lambda r: (
        {n.split(".")[2] for n in r["params"] if n.startswith("model.layers.")} == {str(r["pp_rank"])}
        and f"model.layers.{r['pp_rank']}.self_attn.q_proj.lora_A.weight" in r["params"]
    ),
    "hsdp_2x2": lambda r: (
        _placement(r, f"{L0}.self_attn.q_proj.lora_B.weight", "dp_replicate") == "R"
        and _placement(r, f"{L0}.self_attn.q_proj.lora_B.weight", "dp_shard_cp") == "S(0)"
    ),
    # DDP: whole plain tensors on every rank (its reducer holds only the adapters: frozen parameters get no bucket)
    "ddp2": lambda r: all(p["placements"] is None for p in r["params"].values()),
    # the cp ranks shard parameters with the dp ranks (dp_shard_cp)
    "cp2": lambda r: _placement(r, f"{L0}.self_attn.q_proj.lora_A.weight", "dp_shard_cp") == "S(0)",
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_single_process(name: str, reference: dict, tmp_path: Path) -> None:
    world, dist_section = LAYOUTS[name]
    cfg = tiny_config(str(tmp_path), distributed=dist_section, peft=PEFT)
    results = run_on_ranks(lora_train_on_rank, world_size=world, args=(cfg,), timeout_s=TIMEOUT)
    grads: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(results):
        assert_losses_close(result["losses"], reference["losses"])
        _adapters_only(result)
        result["pp_rank"] = rank  # pp2: rank r holds stage r
        assert APPLIED[name](result), f"{name}: rank {rank} holds {result['params']}"
        grads.update(result["grads"])
    _assert_grads_close(grads, reference["grads"])


def test_lora_moe_ep2_matches_single_process(tmp_path: Path) -> None:
    """Adapters on the attention projections of an MoE model; experts frozen and expert-parallel."""
    ref_cfg = tiny_config(str(tmp_path / "ref"), model=MOE_MODEL, peft=PEFT)
    (ref,) = run_on_ranks(lora_train_on_rank, world_size=1, args=(ref_cfg,), timeout_s=TIMEOUT)
    cfg = tiny_config(
        str(tmp_path / "ep"), model=MOE_MODEL, peft=PEFT, distributed={"strategy": "fsdp2", "ep_size": 2}
    )
    results = run_on_ranks(lora_train_on_rank, world_size=2, args=(cfg,), timeout_s=TIMEOUT)
    experts = f"{L0}.mlp.experts.gate_up_proj"
    for result in results:
        assert_losses_close(result["losses"], ref["losses"])
        _adapters_only(result)
        assert not result["params"][experts]["requires_grad"]
        assert _placement(result, experts, "ep") == "S(0)", result["params"][experts]
        _assert_grads_close(result["grads"], ref["grads"])


# ---- checkpoints: peft format, merged export, resume ---------------------------------------------
def _save_base(directory: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY["model"]["config"])
    torch.manual_seed(123)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(
        directory
    )


def test_adapters_load_in_peft_and_merge_to_the_same_logits(tmp_path: Path) -> None:
    """tp2-sharded adapters of a pretrained model, gathered into ``adapter/``: peft's
    ``PeftModel.from_pretrained`` on the base gives the trained model's logits, and so does
    ``from_pretrained`` of the merged ``consolidated/`` (``peft.save_merged: true``)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    _save_base(tmp_path / "base")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    cfg = tiny_config(
        str(tmp_path / "run"),
        model={"config": None, "pretrained_path": str(tmp_path / "base")},
        peft={**PEFT, "save_merged": True},
        distributed={"strategy": "fsdp2", "tp_size": 2},
        step_scheduler={"max_steps": 2, "val_every_steps": None},
        validation_dataset=None,
        checkpoint={"enabled": True},
    )

    trained = run_on_ranks(lora_train_then_logits, world_size=2, args=(cfg, ids), timeout_s=TIMEOUT)[0]
    step = tmp_path / "run" / "checkpoints" / "step_2"
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"]) == (
        "LORA",
        "CAUSAL_LM",
        4,
        8,
    )
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    weights = load_file(str(step / "adapter" / "adapter_model.safetensors"))
    assert len(weights) == 2 * 7 * 2
    a = weights["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = weights["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"]
    assert a.shape == (4, 64) and b.shape == (64, 4) and b.abs().max() > 0  # full size, trained
    info = json.loads((step / "checkpoint.json").read_text())
    assert info["adapter_files"] == ["adapter/adapter_config.json", "adapter/adapter_model.safetensors"]

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, step / "adapter").eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(step / "consolidated").eval()
        merged_logits = merged(input_ids=ids).logits
    assert not torch.allclose(trained, base_logits, atol=1e-4)  # the adapters changed the model
    torch.testing.assert_close(peft_logits, trained, rtol=RTOL, atol=RTOL)
    torch.testing.assert_close(merged_logits, trained, rtol=RTOL, atol=RTOL)
    assert not any("lora" in k for k in merged.state_dict())


def test_lora_resume_continues_exactly(tmp_path: Path) -> None:
    """The DCP state holds the frozen base, the adapters and their optimizer state: 3 steps on 2
    ranks + resume equals 5 uninterrupted steps of one process."""
    steps = {"max_steps": 5, "val_every_steps": None, "ckpt_every_steps": 2}
    common = {"validation_dataset": None, "lr_scheduler": {"decay_steps": 4}, "peft": PEFT}
    full = tiny_config(str(tmp_path / "full"), step_scheduler={**steps, "ckpt_every_steps": None}, **common)
    (uninterrupted,) = run_on_ranks(train_on_rank, world_size=1, args=(full,), timeout_s=TIMEOUT)
    ckpt = {"enabled": True, "save_consolidated": False}
    first = tiny_config(
        str(tmp_path / "run"), step_scheduler={**steps, "max_steps": 3}, checkpoint=ckpt, **common
    )
    run_on_ranks(train_on_rank, world_size=2, args=(first,), timeout_s=TIMEOUT)
    step3 = tmp_path / "run" / "checkpoints" / "step_3"
    assert (step3 / "adapter" / "adapter_model.safetensors").is_file()
    assert not (step3 / "consolidated").exists()  # LoRA without save_merged: adapter/ instead
    second = tiny_config(str(tmp_path / "run"), step_scheduler=steps, checkpoint=ckpt, **common)
    resumed = run_on_ranks(train_on_rank, world_size=2, args=(second,), timeout_s=TIMEOUT)[0]
    assert_losses_close(resumed, uninterrupted[3:])
