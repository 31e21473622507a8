"""The helpers GPU tests use, checked on CPU: `cuda_probe` (no CUDA initialised in this process) and
`run_torchrun` (output back, failures with the ranks' output, a time-out kills launcher and ranks)."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest
import torch

from automodel.testing.ranks import TorchrunFailure, cuda_device_count, cuda_probe, run_torchrun


def test_cuda_probe_does_not_initialise_cuda_here() -> None:
    count, why = cuda_probe()
    assert count == cuda_device_count() >= 0 and why
    assert not torch.cuda.is_initialized()
    if count == 0:
        assert "no CUDA" in why or "CPU-only" in why, why


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_run_torchrun_runs_gloo_ranks(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        import sys
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        print(f"rank {dist.get_rank()} sum {t.item()} arg {sys.argv[1]}")
        dist.barrier()
        dist.destroy_process_group()
        """,
    )
    proc = run_torchrun(script, nproc_per_node=2, args=["hello"], timeout_s=300)
    assert "rank 0 sum 3.0 arg hello" in proc.stdout and "rank 1 sum 3.0 arg hello" in proc.stdout


def test_run_torchrun_failure_carries_the_ranks_output(tmp_path: Path) -> None:
    script = _script(tmp_path, 'raise KeyError("boom on purpose")\n')
    with pytest.raises(TorchrunFailure, match="exited 1") as info:
        run_torchrun(script, nproc_per_node=1, timeout_s=300)
    assert "boom on purpose" in str(info.value)


def test_run_torchrun_time_out_kills_launcher_and_ranks(tmp_path: Path) -> None:
    pid_file = tmp_path / "rank.pid"
    script = _script(
        tmp_path,
        f"""
        import os, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(600)
        """,
    )
    with pytest.raises(TorchrunFailure, match="ran past 15 s and was killed"):
        run_torchrun(script, nproc_per_node=1, timeout_s=15)
    assert pid_file.exists(), "the rank never started within the time-out (machine too loaded?)"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"rank process {pid} outlived the time-out")
