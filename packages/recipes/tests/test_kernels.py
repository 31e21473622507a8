"""``kernels:`` (Liger) and ``fp8:`` (torchao float8) on CPU: what is refused before launch and why,
Liger's patches landing on the intended modules of a meta-device Llama (its Triton kernels need a
GPU, so nothing patched runs here), and float8 numerics in torchao's emulate mode, in one process
and under FSDP2 with the float8 all-gather on two gloo ranks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import yaml
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import AUTOMODEL_FP8, preload, tiny_config, train_on_rank  # noqa: E402

from automodel.mesh import ParallelismSizes  # noqa: E402
from automodel.recipes import load_config  # noqa: E402
from automodel.recipes.cli import run_cli  # noqa: E402
from automodel.recipes.errors import ConfigError  # noqa: E402
from automodel.recipes.kernels import FP8Section, KernelsSection  # noqa: E402
from automodel.testing.ranks import cuda_device_count, run_on_ranks  # noqa: E402
from automodel.testing.tiny_model import TINY_SIZES, tiny_llama  # noqa: E402

NO_CUDA = pytest.mark.skipif(cuda_device_count() > 0, reason="checks the refusals of machines without CUDA")
SHORT = {"validation_dataset": None, "step_scheduler": {"val_every_steps": None}}


def _cfg(tmp_path: Path, **sections: Any) -> dict[str, Any]:
    return tiny_config(str(tmp_path / "out"), **{**SHORT, **sections})


@pytest.mark.parametrize(
    ("sections", "key", "says"),
    [
        ({"kernels": {"liger": "fast"}}, "kernels.liger", "'fast' is not a Liger patch"),
        ({"kernels": {"liger": ["rms_norm", "rms_norm"]}}, "kernels.liger", "names a patch twice"),
        ({"kernels": {"liger": []}}, "kernels.liger", "non-empty list"),
        ({"kernels": {"triton": True}}, "kernels.triton", "unknown key"),
        ({"fp8": {"enabled": True, "recipe_name": "blockwise"}}, "fp8.recipe_name", "must be one of"),
        (
            {"fp8": {"enabled": True, "recipe_name": "rowwise", "enable_fsdp_float8_all_gather": True}},
            "fp8.enable_fsdp_float8_all_gather",
            "tensorwise only",
        ),
        (
            {"fp8": {"enabled": True, "precompute_float8_dynamic_scale_for_fsdp": True}},
            "fp8.precompute_float8_dynamic_scale_for_fsdp",
            "needs enable_fsdp_float8_all_gather",
        ),
        ({"fp8": {"enabled": True, "filter_fqns": "lm_head"}}, "fp8.filter_fqns", "must be a list"),
        ({"model": {"use_liger_kernel": "yes"}}, "model.use_liger_kernel", "true or false"),
        (
            {"model": {"use_liger_kernel": True}, "kernels": {"liger": True}},
            "model.use_liger_kernel",
            "AutoModel's name of kernels.liger",
        ),
    ],
)
def test_bad_sections_name_the_key(sections: dict, key: str, says: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}=.*{says}"):
        load_config(_cfg(tmp_path, **sections))


def test_automodel_keys_map_to_the_sections(tmp_path: Path) -> None:
    """AutoModel's fp8 section is read as ours; model.use_liger_kernel true is kernels.liger auto
    (applied where it can run), false or absent leaves the kernels off without a line."""
    cfg = load_config(_cfg(tmp_path, fp8=AUTOMODEL_FP8))
    assert cfg.fp8 == FP8Section(**AUTOMODEL_FP8) and cfg.fp8.recipe == "tensorwise" and not cfg.refusals
    assert cfg.fp8.filter_fqns == ("lm_head",)
    auto = load_config(_cfg(tmp_path, model={"use_liger_kernel": True}))
    assert auto.kernels == KernelsSection(liger="auto") and auto.kernels.enabled and not auto.kernels.required
    for model in ({"use_liger_kernel": False}, {}):
        off = load_config(_cfg(tmp_path, model=model))
        assert not off.kernels.enabled and not off.fp8.enabled
        assert not any("liger" in line for line in off.notes)
    assert load_config(_cfg(tmp_path, kernels={"liger": "swiglu"})).kernels.liger == ("swiglu",)


@NO_CUDA
@pytest.mark.parametrize(
    ("sections", "line"),
    [
        ({"kernels": {"liger": True}}, "error: kernels.liger=True: Liger's kernels are Triton GPU kernels"),
        (
            {"kernels": {"liger": ["rms_norm", "fused_linear_cross_entropy"]}},
            "error: kernels.liger=['rms_norm', 'fused_linear_cross_entropy']: Liger's kernels are Triton",
        ),
        ({"fp8": AUTOMODEL_FP8}, "error: fp8.enabled=True: needs a CUDA GPU with float8"),
    ],
    ids=["liger", "liger_list", "fp8"],
)
def test_train_refuses_before_launch_without_cuda(
    sections: dict, line: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "cfg.yaml"
    raw = _cfg(tmp_path, **sections)
    path.write_text(yaml.safe_dump(raw))
    assert run_cli(["train", str(path)]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(line), err
    assert not (tmp_path / "out").exists()
    assert run_cli(["validate", str(path)]) == 0  # validate plans for GPU machines: a line, no refusal
    assert "recipes train on this machine refuses before launch: " + line.removeprefix("error: ") in (
        capsys.readouterr().out
    )


def test_missing_packages_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package check of each extra (on CPU the CUDA check of Liger comes first: it is faked here
    to reach the import; nothing runs on the GPU)."""
    from automodel.recipes.kernels.float8 import fp8_unavailable
    from automodel.recipes.kernels.liger import liger_unavailable

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import raises ImportError
    key, why = fp8_unavailable(FP8Section(enabled=True, emulate=True)) or ("", "")
    assert key == "fp8.enabled" and "automodel-recipes[fp8]" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    assert "automodel-recipes[kernels]" in (liger_unavailable() or "")


@pytest.mark.parametrize(
    ("sections", "world", "key", "says"),
    [
        (
            {
                "kernels": {"liger": True},
                "model": {"config": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}},
            },
            1,
            "kernels.liger",
            "Liger has no kernels for model_type 'gpt2'",
        ),
        ({"kernels": {"liger": ["geglu"]}}, 1, "kernels.liger", "'llama' has no 'geglu'"),
        (
            {
                "kernels": {"liger": ["fused_linear_cross_entropy"]},
                "loss_fn": "automodel.recipes.loss.masked_cross_entropy_sum",
            },
            1,
            "kernels.liger",
            "replaces the chunked linear cross-entropy, which this run does not use",
        ),
        (
            {"kernels": {"liger": True}, "distributed": {"tp_size": 2}},
            2,
            "kernels.liger",
            "tensor parallelism",
        ),
        ({"fp8": AUTOMODEL_FP8, "distributed": {"tp_size": 2}}, 2, "fp8.enabled", "float8 TP styles"),
        ({"fp8": AUTOMODEL_FP8, "peft": {"dim": 4}}, 1, "fp8.enabled", "not wired with peft"),
        (
            {"fp8": AUTOMODEL_FP8, "distributed": {"strategy": "ddp"}},
            2,
            "fp8.enable_fsdp_float8_all_gather",
            "is an FSDP2 option",
        ),
    ],
    ids=["family", "patch", "flce_logits", "liger_tp", "fp8_tp", "fp8_peft", "fp8_ddp_all_gather"],
)
def test_model_and_layout_rules(sections: dict, world: int, key: str, says: str, tmp_path: Path) -> None:
    """Refused by the pre-launch rules (`recipes train` and `validate` run them on the meta model)."""
    from automodel.recipes.plan import plan_layout

    cfg = load_config(_cfg(tmp_path, **sections))
    with pytest.raises(ConfigError, match=rf"^{key}=.*{says}"):
        plan_layout(cfg, world_size=world)


@pytest.fixture
def restore_llama_module():
    """Liger patches the family's modeling module for the whole process: undone after the test."""
    from transformers.models.llama import modeling_llama

    saved = dict(vars(modeling_llama))
    yield modeling_llama
    for key, value in saved.items():
        setattr(modeling_llama, key, value)


def test_liger_patches_the_intended_modules(
    restore_llama_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through Liger's own API on the meta model: every norm and MLP gets Liger's forward, RoPE is
    replaced in modeling_llama, the head keeps nn.Linear's forward and the model's forward is its
    own; the fused linear CE becomes the head loss's linear loss. Nothing runs (Triton needs a GPU)."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    from automodel.recipes.kernels.apply import apply_kernels
    from automodel.recipes.kernels.liger import liger_linear_cross_entropy_sum, resolve_patches
    from automodel.recipes.loss import LinearCrossEntropy, masked_cross_entropy_sum
    from automodel.recipes.output_head import build_head_loss

    modeling = restore_llama_module
    section = KernelsSection(liger=True)
    assert resolve_patches(section, model_type="llama", chunked_head=None) == (
        "rms_norm",
        "rope",
        "swiglu",
        "fused_linear_cross_entropy",
    )
    assert "fused_linear_cross_entropy" not in resolve_patches(
        section, model_type="llama", chunked_head="loss_fn reads logits"
    )
    model = tiny_llama(meta=True)
    forward = type(model).forward
    head_loss = build_head_loss(LinearCrossEntropy(), model=model, logits_loss=masked_cross_entropy_sum)
    cfg = load_config(tiny_config("/tmp/unused", kernels={"liger": True}))
    layout = ParallelismSizes().resolve(1)

    # auto on a machine without CUDA: a line, the model untouched
    if not torch.cuda.is_available():
        auto = load_config(tiny_config("/tmp/unused", kernels={"liger": "auto"}))
        (line,) = apply_kernels(model, cfg=auto, layout=layout, head_loss=head_loss)
        assert line.startswith("kernels.liger: auto") and "not applied" in line and "CUDA" in line
        assert cast(nn.Module, model.model.layers[0].mlp)._get_name() == "LlamaMLP"
        assert modeling.apply_rotary_pos_emb is not liger_rotary_pos_emb
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the CUDA check; nothing runs

    (line,) = apply_kernels(model, cfg=cfg, layout=layout, head_loss=head_loss)
    assert line == "kernels.liger: rms_norm, rope, swiglu, fused_linear_cross_entropy on model_type 'llama'"
    norms = [model.model.norm] + [
        n for layer in model.model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    # Liger binds its forward on each instance (module.__dict__), the class is unchanged
    assert all(vars(n)["forward"].__func__ is LigerRMSNorm.forward for n in norms)
    assert all(vars(layer.mlp)["forward"].__func__ is LigerSwiGLUMLP.forward for layer in model.model.layers)
    assert modeling.apply_rotary_pos_emb is liger_rotary_pos_emb
    assert type(model).forward is forward and "forward" not in vars(model)  # no Liger loss in the model
    assert type(model.lm_head).forward is nn.Linear.forward and "forward" not in vars(model.lm_head)
    assert head_loss.linear_loss is liger_linear_cross_entropy_sum
    assert head_loss.describe() == (
        "loss: Liger's fused linear cross-entropy (replaces the chunked one) over lm_head (no full logits)"
    )


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_emulated_numerics_close_to_fp32(recipe: str) -> None:
    """torchao's emulated float8 (the GPU recipe's casts, matmuls in high precision): every linear
    but the filtered head is a Float8Linear; the loss is within 1e-3 of fp32 (measured 1.8e-4) and
    not equal to it (float8 really ran); each gradient points the same way (cosine >= 0.99) within
    0.15 relative error: gradients are cast to e5m2, whose 2 mantissa bits round by up to 12.5 %
    (measured: at most 0.115, tensorwise)."""
    from torchao.float8.float8_linear import Float8Linear

    from automodel.recipes.kernels.float8 import convert_to_fp8

    ids = torch.randint(0, TINY_SIZES["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(0))
    ref_loss, ref_grads = _loss_and_grads(tiny_llama(seed=0), ids)
    model = tiny_llama(seed=0)
    section = FP8Section(enabled=True, recipe_name=recipe, filter_fqns=["lm_head"], emulate=True)
    converted = convert_to_fp8(model, section=section)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(converted) == sorted(n for n in linears if n != "lm_head") and len(converted) == 14
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in converted)
    assert type(model.lm_head) is nn.Linear
    loss, grads = _loss_and_grads(model, ids)
    assert loss != ref_loss and abs(loss - ref_loss) <= 1e-3 * abs(ref_loss), (loss, ref_loss)
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).norm() / ref.norm()
        cosine = torch.nn.functional.cosine_similarity(grads[name].flatten(), ref.flatten(), dim=0)
        assert err <= 0.15 and cosine >= 0.99, (name, float(err), float(cosine))


def test_fp8_filter_keeps_head_and_refuses_converting_nothing() -> None:
    from automodel.recipes.kernels.float8 import convert_to_fp8

    model = tiny_llama(meta=True)
    converted = convert_to_fp8(model, section=FP8Section(enabled=True, emulate=True), keep=("lm_head",))
    assert "lm_head" not in converted and len(converted) == 14  # the head the chunked loss reads
    with pytest.raises(ConfigError, match=r"^fp8.filter_fqns=\['layers', 'lm_head'\]: leaves no linear"):
        convert_to_fp8(
            tiny_llama(meta=True),
            section=FP8Section(enabled=True, emulate=True, filter_fqns=["layers", "lm_head"]),
        )


def _fp8_rank(raw: dict[str, Any]) -> tuple:
    """Rank function: build and train `raw`; the losses plus what the layout holds."""
    from torchao.float8.float8_linear import Float8Linear

    from automodel.recipes.trainer import Trainer

    trainer = Trainer(load_config(raw))
    trainer.build()
    part = trainer.pm.parts[0]
    fp8 = [m for m in part.modules() if isinstance(m, Float8Linear)]
    result = trainer.train()
    shards = [cast(Any, m.weight)._local_tensor for m in fp8]  # DTensor shards of torchao's wrapper
    locals_ = {type(s).__name__ for s in shards}
    scales = all(getattr(s, "_precomputed_scale", None) is not None for s in shards)
    return result.losses, len(fp8), sorted(locals_), type(part.get_submodule("lm_head")).__name__, scales


def test_fp8_fsdp2_float8_all_gather_two_ranks(tmp_path: Path) -> None:
    """AutoModel's fp8 section (emulated) through `recipes train`'s Trainer on 2 FSDP2 ranks: the
    linears are sharded float8 weights (torchao's all-gather wrapper), the scales are precomputed
    after each optimizer step, and the per-step losses stay within 2e-3 of one fp32 process
    (measured 3.3e-4). Its checkpoint resumes exactly, and its consolidated weights are a plain
    transformers model."""
    import shutil

    from transformers import AutoModelForCausalLM

    preload()
    ref = run_on_ranks(train_on_rank, world_size=1, args=(_cfg(tmp_path / "ref"),))[0]
    raw = _cfg(
        tmp_path / "fp8",
        fp8={**AUTOMODEL_FP8, "emulate": True},
        checkpoint={"enabled": True, "save_consolidated": True},
        step_scheduler={"val_every_steps": None, "ckpt_every_steps": 2},
    )
    results = run_on_ranks(_fp8_rank, world_size=2, args=(raw,), timeout_s=300)
    for losses, count, local_types, head, scales in results:
        assert count == 14 and local_types == ["WeightWithDynamicFloat8CastTensor"] and head == "Linear"
        assert scales
        assert len(losses) == len(ref) == 3
        for got, want in zip(losses, ref):
            assert got != want and abs(got - want) <= 2e-3 * abs(want), (losses, ref)
    ckpts = tmp_path / "fp8" / "out" / "checkpoints"
    shutil.rmtree(ckpts / "step_3")
    (ckpts / "LATEST").write_text("step_2")
    resumed = run_on_ranks(_fp8_rank, world_size=2, args=(raw,), timeout_s=300)
    assert resumed[0][0] == results[0][0][2:]  # step 3 again, bit for bit
    model = AutoModelForCausalLM.from_pretrained(ckpts / "step_2" / "consolidated")
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
