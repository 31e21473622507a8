"""`<output_dir>/metrics.jsonl` (one JSON object per optimizer step, rank 0), optional TensorBoard, and
the experiment trackers (`automodel.recipes.trackers`: ``wandb:``, ``mlflow:``), which get each record."""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from automodel.recipes.trackers import Trackers

#: Keys every metrics.jsonl record carries (the output interface: see the README).
REQUIRED_KEYS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "num_tokens",
    "tokens_per_s",
    "step_time_s",
    "peak_mem_bytes",
)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory allocated, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsWriter:
    """Appends records to metrics.jsonl and mirrors scalars to TensorBoard and the started trackers
    (the same record, at its step); no-op off rank 0."""

    def __init__(
        self,
        output_dir: str | Path,
        *,
        enabled: bool,
        tensorboard: bool,
        resumed_step: int = 0,
        trackers: Trackers | None = None,
    ) -> None:
        self.enabled = enabled
        self.trackers = trackers
        self.path = Path(output_dir) / "metrics.jsonl"
        if enabled:
            truncate_metrics(self.path, keep_through_step=resumed_step)
        self._tb = None
        if enabled and tensorboard:
            # lazy: optional dependency (the [tensorboard] extra)
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(output_dir) / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, int | float):
                    self._tb.add_scalar(f"train/{k}" if k != "val_loss" else "val/loss", v, record["step"])
        if self.trackers is not None:
            self.trackers.log(clean)

    def close(self, *, checkpoint: str | None = None, failed: bool = False) -> None:
        """Close TensorBoard; the trackers get the consolidated checkpoint's path (or None) and end."""
        if self._tb is not None:
            self._tb.close()
        if self.trackers is not None:
            self.trackers.finish(checkpoint=checkpoint, failed=failed)


def truncate_metrics(path: Path, *, keep_through_step: int) -> None:
    """Keep the records of steps ``<= keep_through_step`` (the step a run resumes from).

    Records past it were written by a run that stopped before its next checkpoint; the resumed
    run writes those steps again, and one record per step keeps the curve going forwards. A torn
    last line (a kill mid-write) goes too. The file is replaced atomically.
    """
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and record["step"] <= keep_through_step
        ):
            kept.append(line + "\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
