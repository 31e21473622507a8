"""scripts/gpu_check.sh on a machine without CUDA: it runs, the gpu tests skip with the reason, the
benchmark says there is no CUDA, one summary block reports it, and a pytest failure fails the script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from automodel.testing.ranks import cuda_device_count

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
#: One gpu test file keeps the child pytest's collection short.
ONE_GPU_TEST = "packages/moe-ep/tests/test_units.py"


def _run(tmp_path: Path, *pytest_args: str, bench: bool = True) -> subprocess.CompletedProcess[str]:
    if cuda_device_count() > 0:
        pytest.skip("checks the script's behaviour without CUDA; on a GPU run scripts/gpu_check.sh itself")
    cmd = ["bash", str(SCRIPT), "--python", sys.executable, "--out", str(tmp_path / "out")]
    cmd += [*([] if bench else ["--no-bench"]), "--", *pytest_args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def _summary(proc: subprocess.CompletedProcess[str]) -> str:
    heads = re.findall(r"^=+ gpu_check summary \(\d+ s\) =+$", proc.stdout, flags=re.M)
    assert len(heads) == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout.split(heads[0], 1)[1]


def test_without_cuda_everything_skips_and_the_summary_says_why(tmp_path: Path) -> None:
    proc = _run(tmp_path, ONE_GPU_TEST)
    summary = _summary(proc)
    assert proc.returncode == 0, summary
    assert "pytest -m gpu: 0 passed, 0 failed, 0 errors, 1 skipped (exit 0)" in summary
    # one line per gpu test, with its outcome and reason
    assert re.search(r"^  SKIP  test_units::\S+: needs CUDA \(", summary, flags=re.M), summary
    assert "benchmark: not run, no CUDA here (exit 2): " in summary and "no CUDA" in summary
    assert "recipes train 1B: not run, no CUDA here (exit 2)" in summary
    assert "NeMo AutoModel 0.7.0 peer: not run: no CUDA here" in summary
    assert "environment: torch: " in summary and "gpus: 0" in summary
    assert summary.rstrip().splitlines()[-2].startswith("logs: ")
    assert "status: OK" in summary
    assert (tmp_path / "out" / "junit.xml").exists() and (tmp_path / "out" / "env.txt").exists()


def test_a_pytest_failure_fails_the_script(tmp_path: Path) -> None:
    proc = _run(tmp_path, "no/such/test_file.py", bench=False)
    summary = _summary(proc)
    assert proc.returncode == 1, summary
    assert "benchmark: not run (--no-bench)" in summary
    assert "recipes train 1B: not run (--no-bench)" in summary
    assert "status: FAILED (pytest failed)" in summary
