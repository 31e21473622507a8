"""CUDA-only parity: torch's context_parallel() SDPA path and the Transformer Engine path.

Run by ``nox -s gpu_tests`` (or scripts/gpu_check.sh); skipped (with the reason) without CUDA.
CP ranks need one GPU each (NCCL): each case is a torchrun of `gpu_cp_worker.py`, never ranks
forked from the test process (which cannot use CUDA after a fork). CP over 2 GPUs is the real
test; the 1-GPU case runs the same worker with no CP (backend "none"), so a one-GPU runner still
checks the worker, NCCL start-up and the pass-through path. TE needs the ``[te]`` extra.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from automodel.context_parallel import thd_partitioned_indices
from automodel.testing.ranks import cuda_device_count, run_torchrun

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("gpu_cp_worker.py")


def _need_gpus(n: int) -> None:
    found = cuda_device_count()
    if found < n:
        pytest.skip(f"needs {n} CUDA devices (one per CP rank), found {found}")


#: the worker backends the tests below run (a CPU test parses each one's arguments with the worker's parser)
BACKENDS = ("torch", "te")


def worker_args(tmp_path: Path, *, backend: str) -> tuple[list[str], Path]:
    """The worker's command-line arguments and the report it writes."""
    out = tmp_path / "errors.json"
    return ["--backend", backend, "--out", str(out)], out


def _run_worker(tmp_path: Path, *, gpus: int, backend: str) -> dict:
    args, out = worker_args(tmp_path, backend=backend)
    run_torchrun(WORKER, nproc_per_node=gpus, args=args, timeout_s=600)
    return json.loads(out.read_text())


def _assert_within(report: dict, tol: float) -> None:
    for rank, errs in enumerate(report["errors"]):
        bad = {k: v for k, v in errs.items() if not v < tol}
        assert not bad, f"rank {rank}: {bad}"


def test_torch_backend_worker_without_cp_on_one_gpu(tmp_path: Path) -> None:
    _need_gpus(1)
    report = _run_worker(tmp_path, gpus=1, backend="torch")
    assert report["backend"] == "none" and report["world_size"] == 1
    _assert_within(report, 1e-4)


def test_torch_context_parallel_backend_matches_single_gpu(tmp_path: Path) -> None:
    _need_gpus(2)
    report = _run_worker(tmp_path, gpus=2, backend="torch")
    assert report["backend"] == "torch" and report["world_size"] == 2
    _assert_within(report, 1e-4)


def test_thd_partition_matches_transformer_engine() -> None:
    tex = pytest.importorskip("transformer_engine_torch", reason="transformer-engine is not installed")
    for cp_size in (1, 2, 4):
        unit = 2 * cp_size
        cu = torch.tensor([0, 3 * unit, 4 * unit, 4 * unit, 9 * unit], dtype=torch.int32)
        total = int(cu[-1])
        for rank in range(cp_size):
            theirs = tex.thd_get_partitioned_indices(cu.cuda(), total, cp_size, rank)
            ours = thd_partitioned_indices(cu.cuda(), total, cp_size, rank)
            assert theirs.tolist() == ours.tolist(), (cp_size, rank)


def test_transformer_engine_backend_packed_matches_per_document(tmp_path: Path) -> None:
    pytest.importorskip("transformer_engine.pytorch", reason="transformer-engine is not installed")
    _need_gpus(2)
    report = _run_worker(tmp_path, gpus=2, backend="te")
    assert report["backend"] == "te"
    _assert_within(report, 3e-2)  # bf16 tolerance
