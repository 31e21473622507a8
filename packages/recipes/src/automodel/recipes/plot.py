"""`recipes plot OUTPUT_DIR`: a PNG of the training (and validation) loss from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from automodel.recipes.errors import ConfigError
from automodel.recipes.metrics import read_metrics


def plot_losses(output_dir: str | Path, *, out_file: str | Path | None = None) -> Path:
    """Write ``<output_dir>/loss.png`` (or `out_file`) and return its path."""
    # lazy: start-up, matplotlib ~0.3 s, only for recipes plot
    import matplotlib

    matplotlib.use("Agg")
    # lazy: start-up, matplotlib ~0.3 s, only for recipes plot
    import matplotlib.pyplot as plt

    out_dir = Path(output_dir)
    if not (out_dir / "metrics.jsonl").is_file():
        raise ConfigError("output_dir", str(out_dir), "has no metrics.jsonl")
    records = read_metrics(out_dir)
    if not records:
        raise ConfigError("output_dir", str(out_dir), "metrics.jsonl is empty")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = [r["step"] for r in records if r.get("loss") is not None]
    ax.plot(steps, [r["loss"] for r in records if r.get("loss") is not None], label="train loss")
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (token cross-entropy)")
    ax.set_title(out_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    target = Path(out_file) if out_file is not None else out_dir / "loss.png"
    fig.savefig(target)
    plt.close(fig)
    return target
