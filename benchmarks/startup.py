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

FLOOR_SCRIPT = (
    "import torch, torch.distributed as dist, transformers\n"
    "dist.init_process_group('gloo'); dist.barrier(); dist.destroy_process_group()\n"
)


def config(out: Path, ranks: int) -> dict:
    return {
        "seed": 0,
        "output_dir": str(out),
        "model": {
            "config": {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 256,
                "max_position_embeddings": 64,
                "tie_word_embeddings": False,
            }
        },  # fmt: skip
        "dataset": {"source": "embedded", "seq_length": 32, "max_bytes": 40000},
        "step_scheduler": {"global_batch_size": 2 * ranks, "local_batch_size": 2, "max_steps": 2},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-3},
        "distributed": {"strategy": "fsdp2"},
        "checkpoint": {"enabled": False},
        "logging": {"progress_bar": False},
    }


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
