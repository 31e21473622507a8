"""GPU: a tiny Llama trained 5 steps with megatron_fsdp matches FSDP2 of the same seed and data.

megatron-fsdp needs CUDA, so these run only under ``nox -s gpu_tests`` (or scripts/gpu_check.sh).
Each case is a torchrun of `gpu_parity_worker.py` (NCCL ranks; the fork harness in automodel.mesh
is gloo/CPU only). Cases skip, with the reason, when megatron-fsdp is not importable or the
machine has fewer GPUs than the case needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from automodel.testing.ranks import cuda_device_count, run_torchrun

WORKER = Path(__file__).with_name("gpu_parity_worker.py")

#: (gpus, tp, dtype, rtol). With dp == 1 the worker calls apply_megatron_fsdp directly (the manager
#: would apply TP only), so one GPU exercises megatron-fsdp too.
CASES = [
    pytest.param(1, 1, "fp32", 1e-4, id="1gpu-fp32"),
    pytest.param(1, 1, "bf16", 3e-2, id="1gpu-bf16"),
    pytest.param(2, 1, "bf16", 3e-2, id="2gpu-dp2-bf16"),
    pytest.param(2, 2, "fp32", 1e-4, id="2gpu-tp2-fp32"),
    pytest.param(4, 2, "bf16", 3e-2, id="4gpu-dp2-tp2-bf16"),
]


def worker_args(tmp_path: Path, *, tp: int, dtype: str) -> tuple[list[str], Path]:
    """The worker's command-line arguments (5 steps) and the losses file it writes."""
    out = tmp_path / "losses.json"
    return ["--tp", str(tp), "--dtype", dtype, "--steps", "5", "--out", str(out)], out


@pytest.mark.gpu
@pytest.mark.parametrize("gpus,tp,dtype,rtol", CASES)
def test_megatron_fsdp_matches_fsdp2(gpus: int, tp: int, dtype: str, rtol: float, tmp_path: Path) -> None:
    found = cuda_device_count()
    if found < gpus:
        pytest.skip(f"needs {gpus} GPUs, found {found}")
    pytest.importorskip(
        "megatron_fsdp", reason="megatron-fsdp is not importable (pip install it, or put its wheel in .whl/)"
    )
    args, out = worker_args(tmp_path, tp=tp, dtype=dtype)
    run_torchrun(WORKER, nproc_per_node=gpus, args=args, timeout_s=600)
    result = json.loads(out.read_text())
    assert len(result["megatron_fsdp"]) == 5
    torch.testing.assert_close(result["megatron_fsdp"], result["fsdp2"], rtol=rtol, atol=0)
    assert result["fsdp2"][-1] < result["fsdp2"][0]
