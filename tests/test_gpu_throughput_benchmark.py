"""benchmarks/gpu_throughput.py on CPU (tiny shape, 1-2 steps): the FLOP formula, the ratio to the
plain-torch baseline measured in the same run, and that the baseline runs with automodel NOT importable."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import torch

from automodel.testing.ranks import run_on_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_throughput.py"
TINY_CPU = ["--tiny", "--device", "cpu", "--dtype", "fp32"]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_throughput"] = module
    spec.loader.exec_module(module)
    return module


def test_flops_per_token_by_hand() -> None:
    bench = _load()
    model = bench.build_model(bench.TINY, 32, torch.device("meta"))
    # per layer: q 64*64, k,v 64*32, o 64*64, gate/up/down 3*64*128, two norms 2*64; + lm_head 256*64
    # + final norm 64 (the untied input embedding is a lookup, not a matmul)
    n = 2 * (4096 + 2 * 2048 + 4096 + 3 * 8192 + 128) + 256 * 64 + 64
    attention = 12 * 2 * 4 * 16 * 32
    assert bench.flops_per_token(model, bench.TINY, 32) == 6 * n + attention == 591744


def _run_tiny() -> dict:
    return _load().main([*TINY_CPU, "--steps", "2", "--warmup", "1", "--variants", "plain,base"])


def test_tiny_cpu_mode_reports_ratio_to_plain() -> None:
    (report,) = run_on_ranks(_run_tiny, world_size=1, timeout_s=300)
    plain, base = report["results"]
    assert report["steps"] == 2 and report["shape"] == "tiny" and report["seq_len"] == 32
    assert report["ratio_to"] == "plain" and plain["ratio"] == 1.0
    assert math.isclose(base["ratio"], base["tokens_per_s_per_gpu"] / plain["tokens_per_s_per_gpu"])
    for result in (plain, base):
        assert result["median_step_s"] > 0
        assert math.isclose(result["tokens_per_s_per_gpu"], 32 / result["median_step_s"])
        assert math.isclose(result["mfu"], result["tflops_per_s"] / 989.0)
    assert plain["fsdp"] == "torch.distributed.fsdp.fully_shard (plain torch)"
    assert base["fsdp"] == "automodel.fsdp2.FSDP2Manager"
    assert "torchtitan" in report["torchtitan"]


def _models_left_after_two_variants() -> list[bool]:
    """Which models of a two-variant run are still alive after `main` returns (cyclic GC off)."""
    import gc
    import weakref

    bench = _load()
    built: list[weakref.ref] = []
    build = bench.build_model

    def recording_build(*args, **kwargs):
        model = build(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    setattr(bench, "build_model", recording_build)  # noqa: B010 - a module loaded by path (typed ModuleType)
    gc.disable()  # the collector must not run by chance: the benchmark itself frees each variant
    try:
        bench.main([*TINY_CPU, "--steps", "1", "--warmup", "0", "--variants", "plain,base"])
        return [ref() is not None for ref in built]
    finally:
        gc.enable()


def test_each_variant_is_freed_before_the_next_is_measured() -> None:
    """FSDP2 models sit in reference cycles; a variant left alive inflated the next one's peak."""
    (alive,) = run_on_ranks(_models_left_after_two_variants, world_size=1, timeout_s=300)
    assert alive == [False, False]


#: Runs the benchmark as __main__ with every `automodel` import refused (and recorded), then asks for
#: an automodel variant in the same process, which must stop with a clear message before running.
_BLOCKED = """
import json, runpy, sys

attempts = []

class RefuseAutomodel:
    def find_spec(self, name, path=None, target=None):
        if name == "automodel" or name.startswith("automodel."):
            attempts.append(name)
            raise ImportError(f"automodel is made unimportable by this test ({name})")
        return None

sys.meta_path.insert(0, RefuseAutomodel())
script, out, *argv = sys.argv[1:]
sys.argv = [script, *argv, "--json", out]
module = runpy.run_path(script, run_name="__main__")
print("AUTOMODEL_IMPORTS", json.dumps(attempts + sorted(m for m in sys.modules if m.startswith("automodel"))))
try:
    module["main"]([*argv, "--variants", "plain,base"])
except SystemExit as exc:
    print("BASE_EXIT", exc)
"""


def test_plain_baseline_runs_without_automodel(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = [*TINY_CPU, "--steps", "1", "--warmup", "0", "--variants", "plain,plain+ac"]
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED, str(SCRIPT), str(out), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "AUTOMODEL_IMPORTS []" in lines, proc.stdout
    (ratio,) = [line for line in lines if line.startswith("ratio (tokens/s, same run): ")]
    assert "plain+ac/plain " in ratio and ratio.endswith("x"), ratio
    (base_exit,) = [line for line in lines if line.startswith("BASE_EXIT ")]
    assert "variant 'base' needs automodel importable" in base_exit
    assert "the `plain` variant runs without it" in base_exit
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["results"]] == ["plain", "plain+ac"]
    assert report["ratio_to"] == "plain"


def _run_chunked() -> dict:
    return _load().main([*TINY_CPU, "--steps", "1", "--warmup", "0", "--variants", "base,base+chunked"])


def test_chunked_lever_runs_on_cpu() -> None:
    """The chunked loss probes a meta copy of the model (its meta inputs cannot run through the real
    one: the first GPU run refused with 'Cannot copy out of meta tensor')."""
    (report,) = run_on_ranks(_run_chunked, world_size=1, timeout_s=300)
    assert [r["variant"] for r in report["results"]] == ["base", "base+chunked"]
    assert all(r["tokens_per_s_per_gpu"] > 0 for r in report["results"])


def test_liger_and_fp8_levers_are_the_recipes_code() -> None:
    """The liger and fp8 levers refuse what `recipes train` refuses on this machine, with its
    messages, and apply the recipes' code: Liger's patches on the tiny Llama (undone after the
    variant: modeling_llama is patched process-wide), float8 on every linear but lm_head, Liger's
    fused linear CE in the recipes' head loss. Nothing of Liger runs here (Triton needs a GPU)."""
    import pytest
    from torchao.float8.float8_linear import Float8Linear
    from transformers.models.llama import modeling_llama

    from automodel.recipes.kernels.liger import liger_linear_cross_entropy_sum

    bench = _load()
    cpu = torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="variant part 'liger': Liger's kernels are Triton GPU kernels"):
            bench.check_levers(["compile+liger"], cpu)
    with pytest.raises(SystemExit, match="variant part 'fp8' needs a CUDA GPU"):
        bench.check_levers(["base+fp8"], cpu)
    before = dict(vars(modeling_llama))
    model = bench.build_model(bench.TINY, 32, cpu)
    undo = bench.apply_levers(model, {"liger", "chunked", "fp8"})
    try:
        assert modeling_llama.apply_rotary_pos_emb is not before["apply_rotary_pos_emb"]
        assert {type(m).__name__ for m in model.modules() if m._get_name().startswith("Liger")} == {
            "LlamaRMSNorm",
            "LlamaMLP",
        }
        converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
        assert len(converted) == 14 and "lm_head" not in converted
        meta = bench.build_model(bench.TINY, 32, torch.device("meta"))
        loss_of = bench.make_loss(model, {"chunked", "liger"}, meta_model=meta)
        head_loss = next(
            c.cell_contents for c in loss_of.__closure__ or () if hasattr(c.cell_contents, "plan")
        )
        assert head_loss.linear_loss is liger_linear_cross_entropy_sum
    finally:
        undo()
    assert all(vars(modeling_llama)[k] is v for k, v in before.items())
