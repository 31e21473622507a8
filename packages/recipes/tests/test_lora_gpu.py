"""LoRA on CUDA through `recipes train`: megatron-fsdp (frozen base in its buffers, optimizer over the
adapters) gives fsdp2's losses and writes the same PEFT adapter. Marked gpu; skips without CUDA or
megatron-fsdp. Each run is the CLI in a child process, never ranks forked from the test process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from automodel.mesh.testing import cuda_device_count

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402

pytestmark = pytest.mark.gpu
STEPS = 4
PEFT = {"dim": 4, "alpha": 8}


def _train(out: Path, distributed: dict[str, Any]) -> list[float]:
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
    path = out.with_suffix(".yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "automodel.recipes.cli", "train", str(path), "--nproc-per-node=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=out.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_megatron_fsdp_matches_fsdp2_on_one_gpu(tmp_path: Path) -> None:
    if cuda_device_count() < 1:
        pytest.skip("needs 1 GPU, found 0")
    pytest.importorskip("megatron_fsdp", reason="megatron-fsdp is not importable")
    fp32 = {"mp_policy": {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy"}}
    ref = _train(tmp_path / "fsdp2", {"strategy": "fsdp2", **fp32})
    got = _train(tmp_path / "megatron", {"strategy": "megatron_fsdp", "zero_dp_strategy": 3})
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
