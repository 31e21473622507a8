"""End-to-end tokens/s of `recipes train` vs a minimal hand-written FSDP2 loop (target ratio >= 0.95).

Same model (Llama shape below, fp32), same ranks (torchrun, gloo on CPU), same global batch; both runs are
launched in this process one after the other and the ratio of median tokens/s (warm-up steps dropped) is
printed.

    uv run --frozen python benchmarks/e2e_throughput.py [--ranks 2] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from _recipe_config import llama, recipe_config

HERE = Path(__file__).resolve().parent
SHAPE = dict(hidden=256, intermediate=688, layers=4, heads=8, kv_heads=4, vocab=256, seq=256)
WARMUP = 5


def recipes_config(out: Path, *, steps: int, local_batch: int, ranks: int) -> dict:
    model = llama(
        hidden=SHAPE["hidden"], intermediate=SHAPE["intermediate"], layers=SHAPE["layers"],
        heads=SHAPE["heads"], kv_heads=SHAPE["kv_heads"], vocab=SHAPE["vocab"], max_positions=SHAPE["seq"],
    )  # fmt: skip
    return recipe_config(
        model=model, seq_length=SHAPE["seq"], max_bytes=4_000_000, local_batch=local_batch,
        global_batch=local_batch * ranks, steps=steps, output_dir=str(out), fp32=True,
        optimizer={"lr": 3e-3}, clip_grad_norm={"max_norm": 1.0},
    )  # fmt: skip


def run_recipes(ranks: int, steps: int, local_batch: int, work: Path) -> list[float]:
    out = work / "recipes_run"
    cfg = work / "bench.yaml"
    cfg.write_text(yaml.safe_dump(recipes_config(out, steps=steps, local_batch=local_batch, ranks=ranks)))
    exe = Path(sys.executable).with_name("recipes")
    subprocess.run([str(exe), "train", str(cfg), "--nproc-per-node", str(ranks)], check=True, env=_env())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["tokens_per_s"] for r in rows]


def run_minimal(ranks: int, steps: int, local_batch: int) -> list[float]:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           str(HERE / "_minimal_fsdp2_loop.py"), *args, f"--local-batch={local_batch}", f"--steps={steps}"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env()).stdout
    return [json.loads(x)["tokens_per_s"] for x in out.splitlines() if x.startswith("{")]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--local-batch", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_recipes(a.ranks, a.steps, a.local_batch, Path(tmp))
    base = run_minimal(a.ranks, a.steps, a.local_batch)
    ours_med, base_med = statistics.median(ours[WARMUP:]), statistics.median(base[WARMUP:])
    print(
        f"model {SHAPE}, ranks={a.ranks}, local_batch={a.local_batch}, steps={a.steps} (first {WARMUP} dropped)"
    )
    print(f"recipes train      : {ours_med:10.1f} tokens/s (median)")
    print(f"minimal FSDP2 loop : {base_med:10.1f} tokens/s (median)")
    print(f"ratio recipes/minimal = {ours_med / base_med:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
