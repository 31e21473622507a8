"""A `recipes train` run that a GPU test launches in a child process, split so that its set-up
(config, folders, command) is plain code a CPU test runs: a missing folder or a stale key then fails
CI, not the next GPU run (see tests/test_gpu_code_on_cpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class CliRun:
    """`out` is the run's output_dir; its config is written beside it as ``<out>.yaml``.

    ``cpu=True`` hides the GPUs from the child (gloo, fp32 CPU kernels): a CPU reference run.
    """

    out: Path
    config: dict[str, Any]
    nproc: int
    cpu: bool = False

    @property
    def config_path(self) -> Path:
        return self.out.with_suffix(".yaml")

    def write(self) -> list[str]:
        """Write the YAML (creating its folder) and return the command; no CUDA call."""
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config))
        return [
            sys.executable, "-m", "automodel.recipes.cli", "train", str(self.config_path),
            f"--nproc-per-node={self.nproc}",
        ]  # fmt: skip

    def launch(self, *, timeout_s: float = 900) -> list[dict]:
        """Write, run the CLI (torchrun for 2+ ranks) and return its metrics records."""
        return self.launch_with_stderr(timeout_s=timeout_s)[0]

    def launch_with_stderr(self, *, timeout_s: float = 900) -> tuple[list[dict], str]:
        """`launch`, with what the CLI printed on stderr (its start-up lines)."""
        cmd = self.write()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if self.cpu else None
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, cwd=self.out.parent, env=env
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        records = [json.loads(line) for line in (self.out / "metrics.jsonl").read_text().splitlines()]
        return records, proc.stderr
