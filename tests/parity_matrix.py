"""The parity matrix: every layout, trained through the recipes (YAML config, loop), must reproduce
the single-process per-step losses of the same tiny model, data and seed.

    uv run --frozen python tests/parity_matrix.py            # through the real CLI (torchrun); writes docs/parity.md
    uv run --frozen pytest tests/test_parity_matrix.py       # the same configs as tests, on forked ranks
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from automodel.testing.layout_check import check_layout_applied
from automodel.testing.layout_table import MATRIX_LAYOUTS, Layout
from automodel.testing.tiny_model import TINY_MOE_SIZES, TINY_SIZES

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
RTOL = 1e-5
LAUNCH_TIMEOUT_S = 900

DENSE_MODEL: dict[str, Any] = {"model_type": "llama", **TINY_SIZES, "num_hidden_layers": 4}
MOE_MODEL: dict[str, Any] = {
    "model_type": "qwen3_moe",
    **TINY_SIZES,
    "head_dim": 16,
    **TINY_MOE_SIZES,
    "norm_topk_prob": True,
}


def base_config(model: dict[str, Any]) -> dict[str, Any]:
    return {
        "seed": 11,
        "model": {"config": copy.deepcopy(model), "dtype": "float32"},
        "dataset": {"source": "embedded", "seq_length": 32, "max_bytes": 40000},
        "step_scheduler": {"global_batch_size": 8, "local_batch_size": 2, "max_steps": STEPS},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 3.0e-3, "foreach": False},
        "lr_scheduler": {"warmup_steps": 1, "decay_style": "cosine", "min_lr": 3.0e-4},
        "distributed": {"strategy": "fsdp2"},
        "checkpoint": {"enabled": False},
        "logging": {"progress_bar": False, "layout_report": "all"},
    }


#: The references compute today's full-logits loss (`masked_cross_entropy_sum`); every layout runs
#: the default chunked linear cross-entropy, so each row also checks it against the full logits.
FULL_LOGITS = {"loss_fn": "automodel.recipes.loss.masked_cross_entropy_sum"}
REFERENCES = {
    "dense": Layout("reference_dense", 1, {}, extra=FULL_LOGITS),
    "moe": Layout("reference_moe", 1, {}, model="moe", extra=FULL_LOGITS),
}


def config_for(layout: Layout) -> dict[str, Any]:
    cfg = base_config(MOE_MODEL if layout.model == "moe" else DENSE_MODEL)
    cfg["distributed"].update(copy.deepcopy(layout.distributed))
    for key, value in layout.extra.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def recipes_executable() -> str:
    candidate = Path(sys.executable).with_name("recipes")
    return str(candidate) if candidate.exists() else "recipes"


def preload_for_forked_ranks() -> None:
    """Import the heavy modules once, so ranks forked from this process start warm."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

    import automodel.context_parallel  # noqa: F401
    import automodel.moe  # noqa: F401
    import automodel.pipeline  # noqa: F401
    import automodel.recipes.trainer  # noqa: F401


def _train_forked_rank(raw: dict[str, Any]) -> None:
    from automodel.recipes import load_config
    from automodel.recipes.trainer import run_training

    run_training(load_config(raw))


def run_layout(layout: Layout, workdir: Path, *, launcher: str = "cli") -> list[float]:
    """Train `layout`; rank 0's per-step losses from metrics.jsonl.

    ``launcher="cli"``: the real `recipes train` (YAML file, torchrun, a fresh interpreter per rank).
    ``launcher="forked"``: the same config through the Python API on ranks forked from this process
    (`automodel.testing.ranks.run_on_ranks`; no interpreter start-up per rank, so the test suite can
    afford every layout; the CLI path itself is tested end to end elsewhere). Every rank also writes
    what it holds (``layout/rank_<N>.json``), read by `read_reports`.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    out_dir = workdir / layout.name
    if launcher == "forked":
        from automodel.testing.ranks import run_on_ranks

        preload_for_forked_ranks()
        raw = {**config_for(layout), "output_dir": str(out_dir)}
        run_on_ranks(_train_forked_rank, world_size=layout.ranks, args=(raw,), timeout_s=LAUNCH_TIMEOUT_S)
    elif launcher == "cli":
        cfg_path = workdir / f"{layout.name}.yaml"
        cfg_path.write_text(yaml.safe_dump(config_for(layout), sort_keys=False))
        cmd = [recipes_executable(), "train", str(cfg_path), f"--output_dir={out_dir}"]
        if layout.ranks > 1:
            cmd += ["--nproc-per-node", str(layout.ranks)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env, cwd=workdir
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{layout.name}: `{' '.join(cmd)}` exited {proc.returncode}\n{proc.stderr[-4000:]}"
            )
    else:
        raise ValueError(f"launcher must be cli or forked, got {launcher!r}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r["loss"]) for r in rows]


def read_grad_norms(layout: Layout, workdir: Path) -> list[float]:
    """Rank 0's per-step gradient norms (before clipping) of the run of `layout` in `workdir`."""
    text = (workdir / layout.name / "metrics.jsonl").read_text()
    return [float(json.loads(line)["grad_norm"]) for line in text.splitlines() if line.strip()]


def read_reports(layout: Layout, workdir: Path) -> list[dict[str, Any]]:
    """Each rank's layout report of the run of `layout` in `workdir` (rank order)."""
    layout_dir = workdir / layout.name / "layout"
    return [json.loads((layout_dir / f"rank_{r}.json").read_text()) for r in range(layout.ranks)]


def check_reports(layout: Layout, reports: list[dict[str, Any]]) -> None:
    """Raise AssertionError unless every rank holds what `layout` asks for."""
    model = MOE_MODEL if layout.model == "moe" else DENSE_MODEL
    check_layout_applied(
        reports,
        layout=layout,
        layers=model["num_hidden_layers"],
        num_experts=model.get("num_experts", 0),
    )


def max_relative_difference(got: list[float], ref: list[float]) -> float:
    if len(got) != len(ref):
        return float("inf")
    return max(abs(g - r) / abs(r) for g, r in zip(got, ref))


def write_table(results: list[tuple[Layout, float, str, float]], path: Path) -> None:
    lines = [
        "# Parity matrix",
        "",
        f"Every layout trained through `recipes train` (YAML -> torchrun -> loop) for {STEPS} AdamW steps, fp32,",
        "compared step by step with the single-process run of the same tiny model, data and seed",
        f"(dense: 4-layer Llama; MoE: 2-layer Qwen3-MoE with 4 experts, top-2). Pass: max relative loss difference <= {RTOL:g}.",
        "",
        "Generated by `uv run --frozen python tests/parity_matrix.py` (CPU, gloo); the same runs are the tests in",
        "`tests/test_parity_matrix.py`.",
        "",
        '"placed": every rank\'s `layout/rank_<N>.json` (what it really holds, written by `recipes train`) passes',
        "`automodel.testing.layout_check`: FSDP dim-0 shards over dp_shard_cp, HSDP replicas, TP col/row shards, SP norms",
        "on the tp mesh, disjoint pipeline stages, experts per ep rank, the DDP reducer, the CP ring backend. The",
        "single-process run fails every one of these checks (a test), so parity alone cannot pass a layout.",
        "",
        "`strategy: megatron_fsdp` is not in this CPU matrix: megatron-fsdp needs CUDA, so the recipes refuse it before",
        "launch here; its checks (parity with fsdp2, buffers held, exact resume) are `packages/recipes/tests/test_gpu_megatron.py`.",
        "",
        "| layout | ranks | distributed | max rel. loss diff | placed | wall s | pass |",
        "|---|---|---|---|---|---|---|",
    ]
    for layout, diff, placed, wall in results:
        dist_desc = ", ".join(f"{k}={v}" for k, v in layout.distributed.items()) or "fsdp2 (dp only)"
        ok = "yes" if diff <= RTOL and placed == "yes" else "NO"
        lines.append(
            f"| {layout.name} | {layout.ranks} | {dist_desc} | {diff:.2e} | {placed} | {wall:.0f} | {ok} |"
        )
    lines.append("")
    lines.append(f"Generated {time.strftime('%Y-%m-%d')}.")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="parity_"))
    refs = {kind: run_layout(layout, work) for kind, layout in REFERENCES.items()}
    results = []
    for layout in MATRIX_LAYOUTS:
        start = time.monotonic()
        placed, diff = "no", float("inf")
        try:
            losses = run_layout(layout, work)
            diff = max_relative_difference(losses, refs[layout.model])
            check_reports(layout, read_reports(layout, work))
            placed = "yes"
        except (RuntimeError, AssertionError) as err:
            print(err, file=sys.stderr)
        wall = time.monotonic() - start
        print(
            f"{layout.name:>16} ranks={layout.ranks} max_rel_diff={diff:.2e} placed={placed} wall={wall:.0f}s",
            flush=True,
        )
        results.append((layout, diff, placed, wall))
    write_table(results, ROOT / "docs" / "parity.md")


if __name__ == "__main__":
    main()
