"""GPU test code run on CPU as far as its logic allows (CI has no GPU; GPU machines are rare).

Every torchrun worker a GPU test launches is imported and parses the arguments its test passes;
every module holding `gpu`-marked tests is imported; the recipes' GPU tests write their configs
(folders included) and `load_config` accepts them. A stale import, a renamed option or a missing
folder then fails here instead of on the next GPU run. `nox -s typecheck` checks the rest.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST_DIRS = [*sorted(ROOT.glob("packages/*/tests")), ROOT / "tests"]


def _load(path: Path) -> ModuleType:
    """Import a file by path under a name unique to it (several packages have a test_gpu.py)."""
    name = "gpu_on_cpu__" + re.sub(r"\W", "_", str(path.relative_to(ROOT).with_suffix("")))
    if name in sys.modules:
        return sys.modules[name]
    if str(path.parent) not in sys.path:  # its sibling helpers, as its conftest or pytest would
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _files(pattern: str) -> list[Path]:
    return sorted(p for d in TEST_DIRS for p in d.rglob("*.py") if re.search(pattern, p.read_text()))


WORKERS = sorted(p for d in TEST_DIRS for p in d.rglob("*worker*.py"))
GPU_TEST_MODULES = [p for p in _files(r"mark\.gpu") if p.name.startswith("test_") and p != Path(__file__)]


def test_the_gpu_files_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in WORKERS + GPU_TEST_MODULES}
    assert {
        "packages/megatron-fsdp-adapter/tests/gpu_parity_worker.py",
        "packages/context-parallel/tests/gpu_cp_worker.py",
        "packages/recipes/tests/test_gpu.py",
        "packages/recipes/tests/test_gpu_megatron.py",
        "packages/recipes/tests/test_lora_gpu.py",
        "packages/fsdp2/tests/test_gpu.py",
    } <= names, names
    # every worker is launched by a test module that names it
    for worker in WORKERS:
        assert any(worker.name in p.read_text() for p in GPU_TEST_MODULES), worker


@pytest.mark.parametrize("path", WORKERS + GPU_TEST_MODULES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_gpu_workers_and_test_modules_import(path: Path) -> None:
    _load(path)


def test_megatron_worker_parses_every_cases_arguments(tmp_path: Path) -> None:
    tests = _load(ROOT / "packages/megatron-fsdp-adapter/tests/test_gpu.py")
    worker = _load(tests.WORKER)
    for case in tests.CASES:
        _, tp, dtype, _ = case.values
        args, out = tests.worker_args(tmp_path, tp=tp, dtype=dtype)
        parsed = worker.parse_args(args)
        assert (parsed.tp, parsed.dtype, parsed.out) == (tp, dtype, str(out))


def test_cp_worker_parses_every_backends_arguments(tmp_path: Path) -> None:
    tests = _load(ROOT / "packages/context-parallel/tests/test_gpu.py")
    worker = _load(tests.WORKER)
    for backend in tests.BACKENDS:
        args, out = tests.worker_args(tmp_path, backend=backend)
        parsed = worker.parse_args(args)
        assert (parsed.backend, parsed.out) == (backend, str(out))


def _recipes_gpu_runs(tmp_path: Path) -> dict[str, list]:
    """Every `recipes train` run of the recipes' GPU tests, by test, built by the tests' own set-up."""
    base = ROOT / "packages/recipes/tests"
    gpu, megatron, lora, kernels = (
        _load(base / f)
        for f in ("test_gpu.py", "test_gpu_megatron.py", "test_lora_gpu.py", "test_kernels_gpu.py")
    )
    return {
        "test_fsdp2_on_gpus_matches_the_cpu_run_and_bf16_stays_close": [
            *gpu.fsdp2_runs(tmp_path / "fsdp2", 2).values()
        ],
        "test_async_checkpoint_on_one_gpu_stages_pinned_and_resumes": [
            *gpu.async_checkpoint_runs(tmp_path / "async").values()
        ],
        "test_megatron_fsdp_matches_fsdp2_and_really_wraps[1gpu]": [
            *megatron.parity_runs(tmp_path / "parity1", 1).values()
        ],
        "test_megatron_fsdp_matches_fsdp2_and_really_wraps[2gpu-dp2]": [
            *megatron.parity_runs(tmp_path / "parity2", 2).values()
        ],
        "test_megatron_fsdp_resume_is_exact_and_consolidated_loads": megatron.resume_runs(
            tmp_path / "resume"
        ),
        "test_lora_megatron_fsdp_matches_fsdp2_on_one_gpu": [*lora.lora_runs(tmp_path / "lora").values()],
        "test_liger_kernels_reproduce_the_fp32_run / test_fp8_follows_the_bf16_run": [
            *kernels.kernels_runs(tmp_path / "kernels").values()
        ],
    }


def test_recipes_gpu_tests_write_configs_that_load(tmp_path: Path) -> None:
    """Each run writes its YAML into a folder it creates (the FileNotFoundError a GPU run once hit
    on `<tmp>/cpu/cfg.yaml`), launches the CLI on that file, and `load_config` accepts it."""
    from automodel.recipes import load_config

    for test, runs in _recipes_gpu_runs(tmp_path).items():
        for run in runs:
            cmd = run.write()
            assert run.config_path.is_file() and str(run.config_path) in cmd, (test, cmd)
            assert cmd[-1] == f"--nproc-per-node={run.nproc}", (test, cmd)
            cfg = load_config(run.config_path)
            assert Path(cfg.output_dir) == run.out, (test, cfg.output_dir)
