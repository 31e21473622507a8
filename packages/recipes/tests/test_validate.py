"""`recipes validate`: GPU-scale examples plan for 1024 ranks; impossible layouts name the broken rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from automodel.recipes.cli import run_cli

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
GPU_SCALE = ["llama3_8b_8gpu.yaml", "llama3_70b_64gpu.yaml", "moe_30b_a3b_8gpu.yaml"]


@pytest.mark.parametrize("name", GPU_SCALE)
def test_gpu_scale_example_validates_for_1024_ranks(name: str, capsys: pytest.CaptureFixture) -> None:
    assert run_cli(["validate", str(EXAMPLES / name), "--world-size=1024"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "config OK for world_size=1024" in out
    assert "per-rank memory estimate" in out


def test_layout_table_and_memory_estimate(capsys: pytest.CaptureFixture) -> None:
    assert run_cli(["validate", str(EXAMPLES / "llama3_70b_64gpu.yaml"), "--world-size=64"]) == 0
    out = capsys.readouterr().out
    rows = dict(
        line.split() for line in out.splitlines() if line.split()[:1] in (["pp"], ["tp"], ["dp"], ["cp"])
    )
    assert rows == {"pp": "4", "tp": "8", "dp": "2", "cp": "1"}
    assert "interleaved1f1b, 8 stages" in out


def test_memory_estimate_scales_with_sharding() -> None:
    from automodel.recipes.loader import load_config
    from automodel.recipes.plan import plan_layout
    from automodel.recipes.recipe_config import parse_recipe_config

    cfg = parse_recipe_config(load_config(EXAMPLES / "llama3_8b_8gpu.yaml"))
    _, mem8, _ = plan_layout(cfg, world_size=8)
    _, mem64, _ = plan_layout(cfg, world_size=64)
    assert mem8.total_params > 8e9
    assert mem8.params_per_rank == pytest.approx(mem8.total_params / 8)
    assert mem64.params_per_rank == pytest.approx(mem8.params_per_rank / 8)
    assert mem8.optimizer_bytes == pytest.approx(2 * 4 * mem8.params_per_rank)


@pytest.mark.parametrize(
    ("zero", "sharded"),
    [(0, ""), (1, "o"), (2, "og"), (3, "ogw"), ("optim_grads", "og")],
    ids=["no_shard", "optim", "optim_grads", "optim_grads_params", "by_name"],
)
def test_megatron_fsdp_estimate_follows_zero_dp_strategy(zero: int | str, sharded: str) -> None:
    """megatron-fsdp shards optimizer state from level 1, gradients from 2, weights at 3; fp32
    main grads and fp32 master weights follow grad_reduce_in_fp32 and preserve_fp32_weights."""
    from automodel.recipes.loader import load_config
    from automodel.recipes.plan import plan_layout
    from automodel.recipes.recipe_config import parse_recipe_config

    raw = load_config(EXAMPLES / "llama_megatron_fsdp.yaml")
    raw["model"]["dtype"] = "bfloat16"
    raw["step_scheduler"]["global_batch_size"] = 32
    raw["distributed"].update(
        tp_size=1, zero_dp_strategy=zero, grad_reduce_in_fp32=True, preserve_fp32_weights=True
    )
    _, mem, _ = plan_layout(parse_recipe_config(raw), world_size=8)
    n = mem.total_params
    share = {kind: n / 8 if kind in sharded else n for kind in "ogw"}
    assert mem.param_bytes == pytest.approx(share["w"] * 2)  # bf16 weights
    assert mem.grad_bytes == pytest.approx(share["g"] * 4)  # fp32 main grads
    assert mem.optimizer_bytes == pytest.approx(share["o"] * 4 * 3)  # two Adam moments + fp32 master


@pytest.mark.parametrize(
    ("name", "args", "rule"),
    [
        ("llama3_70b_64gpu.yaml", ["--world-size=1000"], "is not divisible by pp_size*cp_size*tp_size"),
        ("llama3_70b_64gpu.yaml", ["--world-size=1024", "--distributed.tp_size=16"], "num_key_value_heads=8"),
        (
            "llama3_70b_64gpu.yaml",
            ["--world-size=1024", "--distributed.pp_size=64"],
            "128 pipeline stages",
        ),
        (
            "moe_30b_a3b_8gpu.yaml",
            ["--world-size=1024", "--distributed.ep_size=256"],
            "number of experts (128)",
        ),
        (
            "llama3_8b_8gpu.yaml",
            ["--world-size=1024", "--distributed.cp_size=8", "--dataset.seq_length=8200"],
            "2*cp_size",
        ),
        (
            "llama3_8b_8gpu.yaml",
            ["--world-size=1024", "--step_scheduler.local_batch_size=2"],
            "local_batch_size*dp",
        ),
    ],
)
def test_impossible_layout_fails_with_rule(
    name: str, args: list[str], rule: str, capsys: pytest.CaptureFixture
) -> None:
    assert run_cli(["validate", str(EXAMPLES / name), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and rule in err[0], err


def _documented_world(path: Path) -> int:
    import re

    match = re.search(r"--nproc-per-node (\d+)", path.read_text())
    assert match, f"{path.name} documents no --nproc-per-node"
    return int(match.group(1))


@pytest.mark.parametrize(
    "path", sorted(p for p in EXAMPLES.glob("*.yaml") if p.name not in GPU_SCALE), ids=lambda p: p.name
)
def test_every_cpu_example_validates_for_its_documented_world(
    path: Path, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    import yaml

    world = _documented_world(path)
    extra = []
    model = yaml.safe_load(path.read_text())["model"]
    source = model.get("pretrained_model_name_or_path")
    if source and source.startswith("runs/"):
        # A checkpoint another example writes (sft.yaml fine-tunes the quickstart's): a clean
        # clone has none, so stand in the quickstart model's config (all validate reads).
        from transformers import AutoConfig

        quick = dict(yaml.safe_load((EXAMPLES / "quickstart.yaml").read_text())["model"]["config"])
        AutoConfig.for_model(quick.pop("model_type"), **quick).save_pretrained(tmp_path / "ckpt")
        extra = [f"--model.pretrained_model_name_or_path={tmp_path / 'ckpt'}"]
    assert run_cli(["validate", str(path), f"--world-size={world}", *extra]) == 0, capsys.readouterr().err


def test_validate_builds_the_meta_model_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules (pipeline split check), the parameter counts and LoRA share one meta-device model:
    building a 70B model costs ~0.2 s, and validate of a 16,384-rank job must stay under 10 s."""
    from transformers import AutoModelForCausalLM

    from automodel.recipes.loader import load_config
    from automodel.recipes.plan import plan_layout
    from automodel.recipes.recipe_config import parse_recipe_config

    builds: list[str] = []
    original = AutoModelForCausalLM.from_config

    def counting(cls, config, **kwargs):
        builds.append(config.model_type)
        return original(config, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", classmethod(counting))
    raw = load_config(EXAMPLES / "llama_pp.yaml")
    raw["peft"] = {"target_modules": ["*_proj"]}
    _, mem, _ = plan_layout(parse_recipe_config(raw), world_size=2)
    assert builds == ["llama"]
    assert mem.peak_bytes > 0


@pytest.mark.parametrize(
    "model_config",
    [
        {
            "model_type": "mamba",
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "vocab_size": 256,
            "state_size": 8,
        },
        {"model_type": "rwkv", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256},
    ],
    ids=["mamba", "rwkv"],
)
def test_attention_free_models_validate_and_estimate(model_config: dict, tmp_path: Path) -> None:
    """`recipes train` validates every config before launch: models without attention heads must
    get an estimate (no attention activations), not an AttributeError."""
    from automodel.recipes import load_config
    from automodel.recipes.plan import plan_layout

    cfg = load_config({"model": {"config": model_config}, "output_dir": str(tmp_path)})
    _, mem, _ = plan_layout(cfg, world_size=1)
    assert mem.peak_bytes > 0


@pytest.mark.parametrize(
    ("dtype", "mp_param", "bytes_per_param"),
    [
        ("bf16", None, 2),
        ("fp32", None, 4),
        ("half", None, 2),
        ("fp16", "bf16", 2),
        ("torch.float32", "fp32", 4),
    ],
)
def test_every_dtype_spelling_validates(
    dtype: str, mp_param: str | None, bytes_per_param: int, capsys: pytest.CaptureFixture
) -> None:
    """model.dtype and mp_policy dtypes accept every name `automodel.mesh.parse_dtype` does (bf16
    crashed validate with "torch has no attribute bf16")."""
    args = ["validate", str(EXAMPLES / "llama_fsdp2.yaml"), "--world-size=2", f"--model.dtype={dtype}"]
    if mp_param is not None:
        args.append(f"--distributed.mp_policy={{param_dtype: {mp_param}, reduce_dtype: fp32}}")
    assert run_cli(args) == 0, capsys.readouterr().err
    from automodel.recipes.loader import load_config
    from automodel.recipes.plan import plan_layout
    from automodel.recipes.recipe_config import parse_recipe_config

    raw = load_config(EXAMPLES / "llama_fsdp2.yaml")
    raw["model"]["dtype"] = dtype
    _, mem, _ = plan_layout(parse_recipe_config(raw), world_size=2)
    assert mem.param_bytes == pytest.approx(mem.params_per_rank * bytes_per_param)


def test_unknown_dtype_names_the_key(capsys: pytest.CaptureFixture) -> None:
    assert run_cli(["validate", str(EXAMPLES / "llama_fsdp2.yaml"), "--model.dtype=bf17"]) == 2
    assert "model.dtype" in capsys.readouterr().err


GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64}
PER_LAYER = {"activation_checkpointing": True, "enable_compile": True, "enable_fsdp2_prefetch": True}


def test_gpt2_per_layer_features_validate_and_tp_is_refused_naming_the_key(tmp_path: Path) -> None:
    """GPT-2's layers sit at transformer.h: per-layer features are accepted (the ranks find the
    layers), TP is refused before launch (GPT-2 declares no TP plan), naming distributed.tp_size."""
    from automodel.recipes import load_config
    from automodel.recipes.errors import ConfigError
    from automodel.recipes.plan import plan_layout

    raw = {"model": {"config": GPT2}, "output_dir": str(tmp_path), "distributed": dict(PER_LAYER)}
    _, mem, _ = plan_layout(load_config(raw), world_size=2)
    assert mem.peak_bytes > 0
    raw["distributed"] = {**PER_LAYER, "tp_size": 2}
    with pytest.raises(ConfigError, match="distributed.tp_size") as err:
        plan_layout(load_config(raw), world_size=2)
    assert "tensor-parallel plan" in str(err.value)


@pytest.mark.parametrize("flag", sorted(PER_LAYER))
def test_per_layer_feature_on_a_model_without_layers_is_refused(flag: str, tmp_path: Path) -> None:
    from torch import nn

    from automodel.recipes import load_config
    from automodel.recipes._dist_setup import resolve_layout
    from automodel.recipes.errors import ConfigError
    from automodel.recipes.model import build_hf_config
    from automodel.recipes.rules import check_layout_rules

    cfg = load_config({"model": {"config": GPT2}, "output_dir": str(tmp_path), "distributed": {flag: True}})
    layout = resolve_layout(cfg.distributed, 2)
    no_layers = nn.Sequential(nn.Embedding(4, 4), nn.Linear(4, 4))
    with pytest.raises(ConfigError, match=f"distributed.{flag}.*no ModuleList of decoder layers"):
        check_layout_rules(cfg, layout, build_hf_config(cfg.model), model=no_layers)


def test_validate_reports_what_train_would_refuse_on_this_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """nccl without CUDA: validate still plans (it may target a cluster) and says train refuses here."""
    import yaml

    from automodel.recipes.cli import run_cli
    from automodel.testing.ranks import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("checks a machine without CUDA")
    cfg = {
        "model": {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "vocab_size": 256, "max_position_embeddings": 64}},
        "dataset": {"source": "embedded", "seq_length": 32, "max_bytes": 40000},
        "step_scheduler": {"global_batch_size": 8, "local_batch_size": 2, "max_steps": 3},
        "dist_env": {"backend": "nccl"},
    }  # fmt: skip
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert run_cli(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "peak" in out
    assert "recipes train on this machine refuses before launch: dist_env.backend='nccl': needs CUDA" in out
