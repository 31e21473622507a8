"""Start `recipes train` processes the way a user, torchrun's nodes or SLURM's srun would (tests)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402

#: Launcher variables a test environment must not inherit from the shell that runs pytest.
LAUNCH_PREFIXES = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_", "ROLE_",
                   "MASTER_", "TORCHELASTIC", "PET_", "NPROC_PER_NODE", "KUBERNETES_SERVICE_")  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES)}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def free_port(low: int = 0, high: int = 0) -> int:
    """A port nobody listens on (in [low, high) when given)."""
    for _ in range(200):
        port = random.randrange(low, high) if high else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in [{low}, {high})")


def write_config(tmp: Path, output_dir: Path, *, steps: int, **sections: Any) -> Path:
    """The tiny Llama of the recipes tests: `steps` steps, a checkpoint every 2, no validation."""
    checkpoint = {"enabled": True, "save_consolidated": False, **sections.pop("checkpoint", {})}
    cfg = tiny_config(
        str(output_dir),
        step_scheduler={"max_steps": steps, "val_every_steps": None, "ckpt_every_steps": 2},
        validation_dataset=None,
        checkpoint=checkpoint,
        **sections,
    )
    path = tmp / f"{output_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_train(
    config: Path, *args: str, log: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """`recipes train CONFIG ARGS` in the background, stderr to `log` (a file: a full pipe stalls)."""
    cmd = [sys.executable, "-m", "automodel.recipes.cli", "train", str(config), *args]
    with open(log, "w") as f:
        return subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=f, env=env or clean_env(), cwd=cwd or log.parent
        )


def finish(procs: list[subprocess.Popen], logs: list[Path], *, timeout: float = 300) -> list[str]:
    """Wait for every launcher (killing any left when one times out), assert each exited 0 (the
    logs' tails in the message), and return the logs' texts."""
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [log.read_text() for log in logs]
    tails = "\n".join(f"--- {log.name}:\n{text[-3000:]}" for log, text in zip(logs, texts))
    assert codes == [0] * len(procs), tails
    return texts


def losses(output_dir: Path) -> dict[int, float]:
    """step -> loss of `output_dir`/metrics.jsonl."""
    path = output_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {r["step"]: r["loss"] for r in records}


def error_lines(text: str) -> list[str]:
    """The lines of a stderr that are not progress output (progress lines start with ``[rank N]``)."""
    return [line for line in text.splitlines() if line.strip() and not line.startswith("[rank ")]
