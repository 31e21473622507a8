"""Peak memory of the loss: full logits vs the chunked linear cross-entropy, in one run (CPU).

Part 1, the loss alone at the Llama-3.2-1B head shape: hidden states [4096, 2048], head [128256,
2048], fp32, forward + backward. Each variant runs in its own forked process; the figure is its
peak resident set (ru_maxrss) above the resident set once the inputs exist (target: chunked <= 1/4
of full). Part 2 (``--recipes``): `recipes train` of a 1-layer Llama (hidden 128, tied, vocab
128256), seq 4096, one rank, 2 steps, peak RSS from metrics.jsonl, with each loss (target <= 2 GiB
with the default, chunked, loss).

    uv run --frozen python benchmarks/loss_memory.py [--recipes]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

GIB = 1 << 30
TOKENS, HIDDEN, VOCAB = 4096, 2048, 128256
FULL = "automodel.recipes.loss.masked_cross_entropy_sum"
CHUNKED = "automodel.recipes.loss.LinearCrossEntropy"


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _loss_peak(variant: str, queue: mp.Queue) -> None:
    import torch
    import torch.nn.functional as F

    from automodel.recipes.linear_ce import linear_cross_entropy_sum

    torch.manual_seed(0)
    hidden = (torch.randn(TOKENS, HIDDEN) * 0.5).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,))
    base = _rss_bytes()
    started = time.perf_counter()
    if variant == "full":
        loss = F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")
    else:
        loss = linear_cross_entropy_sum(hidden, weight, labels)
    loss.backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grads = float(hidden.grad.norm()), float(weight.grad.norm())
    queue.put(
        {"variant": variant, "peak_bytes": peak - base, "loss": float(loss), "grads": grads, "s": seconds}
    )


def loss_alone() -> dict[str, dict]:
    ctx = mp.get_context("fork")
    results = {}
    for variant in ("full", "chunked"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_loss_peak, args=(variant, queue))
        proc.start()
        results[variant] = queue.get(timeout=1800)
        proc.join()
    return results


def recipes_config(out: str, loss_fn: str) -> dict:
    return {
        "seed": 0,
        "output_dir": out,
        "model": {
            "dtype": "float32",
            "config": {
                "model_type": "llama",
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": VOCAB,
                "max_position_embeddings": 4096,
                "tie_word_embeddings": True,
            },
        },
        "dataset": {"source": "embedded", "seq_length": 4096, "max_bytes": 40000},
        "step_scheduler": {"global_batch_size": 1, "local_batch_size": 1, "max_steps": 2},
        "optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-3},
        "distributed": {"strategy": "fsdp2"},
        "loss_fn": loss_fn,
        "checkpoint": {"enabled": False},
        "logging": {"progress_bar": False},
    }


def recipes_peak(loss_fn: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "cfg.yaml"
        cfg.write_text(yaml.safe_dump(recipes_config(str(Path(tmp) / "out"), loss_fn)))
        exe = Path(sys.executable).with_name("recipes")
        proc = subprocess.run(
            [str(exe if exe.exists() else "recipes"), "train", str(cfg)],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")},
        )
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        rows = [json.loads(line) for line in (Path(tmp) / "out" / "metrics.jsonl").read_text().splitlines()]
        line = next((x for x in proc.stderr.splitlines() if x.startswith("loss:")), "")
        return {
            "peak_bytes": max(r["peak_mem_bytes"] for r in rows),
            "losses": [r["loss"] for r in rows],
            "line": line,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", action="store_true", help="also the 1-layer `recipes train` runs")
    args = parser.parse_args()
    res = loss_alone()
    full, chunked = res["full"], res["chunked"]
    print(f"loss alone, hidden [{TOKENS}, {HIDDEN}] x head [{VOCAB}, {HIDDEN}], fp32, forward + backward:")
    for name, r in res.items():
        print(f"  {name:>8}: peak +{r['peak_bytes'] / GIB:.2f} GiB, {r['s']:.1f} s, loss {r['loss']:.4f}")
    ratio = chunked["peak_bytes"] / full["peak_bytes"]
    rel = abs(chunked["loss"] - full["loss"]) / abs(full["loss"])
    print(f"  chunked / full peak = {ratio:.3f} (target <= 0.25); loss rel. diff {rel:.1e}")
    if args.recipes:
        print("recipes train, 1-layer Llama (hidden 128, tied, vocab 128256), seq 4096, 1 rank, 2 steps:")
        for name, fn in (("full", FULL), ("chunked", CHUNKED)):
            r = recipes_peak(fn)
            print(
                f"  {name:>8}: peak RSS {r['peak_bytes'] / GIB:.2f} GiB, losses {r['losses']} ({r['line']})"
            )


if __name__ == "__main__":
    main()
