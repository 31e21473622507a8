"""Start-up: wall time from launching `recipes train` to its first finished step, at 2/4/8 ranks.

Measured from `subprocess.Popen` to the moment the first line appears in metrics.jsonl (tiny Llama,
fsdp2, gloo on CPU). Baseline in the same run: a bare `torchrun` of a script that only imports torch
and transformers and initializes the process group, i.e. the launcher + import floor.

    uv run --frozen python benchmarks/startup.py [--ranks 2 4 8]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _recipe_config import llama, recipe_config

FLOOR_SCRIPT = (
    "import torch, torch.distributed as dist, transformers\n"
    "dist.init_process_group('gloo'); dist.barrier(); dist.destroy_process_group()\n"
)


def config(out: Path, ranks: int) -> dict:
    model = llama(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, max_positions=64)
    return recipe_config(
        model=model,
        seq_length=32,
        max_bytes=40000,
        local_batch=2,
        global_batch=2 * ranks,
        steps=2,
        output_dir=str(out),
    )


def time_to_first_step(ranks: int, work: Path) -> float:
    out = work / f"run{ranks}"
    cfg = work / f"startup{ranks}.yaml"
    cfg.write_text(yaml.safe_dump(config(out, ranks)))
    exe = Path(sys.executable).with_name("recipes")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.Popen([str(exe), "train", str(cfg), "--nproc-per-node", str(ranks)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        if proc.poll() is not None and not metrics.exists():
            raise RuntimeError(f"recipes train exited {proc.returncode} before its first step")
        time.sleep(0.05)
    first = time.perf_counter() - start
    proc.wait()
    return first


def floor(ranks: int, work: Path) -> float:
    script = work / "floor.py"
    script.write_text(FLOOR_SCRIPT)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                    str(script)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    a = p.parse_args()
    print(f"{'ranks':>5} {'launch->first step s':>21} {'torchrun+import floor s':>24} {'ratio':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in a.ranks:
            ours, base = time_to_first_step(ranks, Path(tmp)), floor(ranks, Path(tmp))
            print(f"{ranks:>5} {ours:>21.1f} {base:>24.1f} {ours / base:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
