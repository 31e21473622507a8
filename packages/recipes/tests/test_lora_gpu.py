"""LoRA on CUDA through `recipes train`: megatron-fsdp (frozen base in its buffers, optimizer over the
adapters) gives fsdp2's losses and writes the same PEFT adapter. Marked gpu; skips without CUDA or
megatron-fsdp. Each run is the CLI in a child process, never ranks forked from the test process."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from automodel.testing.ranks import cuda_device_count

sys.path.insert(0, str(Path(__file__).parent))
from _cli_run import CliRun  # noqa: E402
from _recipe_helpers import tiny_config  # noqa: E402

pytestmark = pytest.mark.gpu
STEPS = 4
PEFT = {"dim": 4, "alpha": 8}


def _run(out: Path, distributed: dict[str, Any]) -> CliRun:
    cfg = tiny_config(
        str(out),
        step_scheduler={"max_steps": STEPS, "val_every_steps": None},
        distributed=distributed,
        peft=PEFT,
        checkpoint={"enabled": True, "save_consolidated": False},
        logging={"progress_bar": False, "layout_report": "all"},
    )
    cfg.pop("validation_dataset")
    cfg["model"]["dtype"] = "float32"
    return CliRun(out, cfg, nproc=1)


def lora_runs(tmp_path: Path) -> dict[str, CliRun]:
    """LoRA through fsdp2 (fp32) and megatron_fsdp (ZeRO-3) on one GPU: the test's runs."""
    fp32 = {"mp_policy": {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy"}}
    return {
        "fsdp2": _run(tmp_path / "fsdp2", {"strategy": "fsdp2", **fp32}),
        "megatron": _run(tmp_path / "megatron", {"strategy": "megatron_fsdp", "zero_dp_strategy": 3}),
    }


def test_lora_megatron_fsdp_matches_fsdp2_on_one_gpu(tmp_path: Path) -> None:
    if cuda_device_count() < 1:
        pytest.skip("needs 1 GPU, found 0")
    pytest.importorskip("megatron_fsdp", reason="megatron-fsdp is not importable")
    runs = lora_runs(tmp_path)
    ref, got = ([r["loss"] for r in runs[name].launch()] for name in ("fsdp2", "megatron"))
    assert len(got) == len(ref) == STEPS
    for step, (g, r) in enumerate(zip(got, ref), start=1):
        assert abs(g - r) <= 1e-4 * abs(r), f"step {step}: {g} vs fsdp2 {r}"
    assert ref[0] != ref[-1]
    for run in ("fsdp2", "megatron"):
        adapter = tmp_path / run / "checkpoints" / f"step_{STEPS}" / "adapter"
        assert (adapter / "adapter_model.safetensors").is_file(), run
    report = json.loads((tmp_path / "megatron" / "layout" / "rank_0.json").read_text())
    assert report["parts"][0]["wrapper"] == "MegatronFSDP"
    assert any(".lora_A." in name for name in report["parts"][0]["parameters"])
