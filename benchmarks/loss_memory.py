"""Peak memory of the loss: full logits vs the chunked linear cross-entropy, in one run (CPU).

Part 1, the loss alone at the Llama-3.2-1B head shape: hidden states [4096, 2048], head [128256,
2048], fp32, forward + backward. Each variant runs in its own forked process; the figure is its
peak resident set (ru_maxrss) above the resident set once the inputs exist (target: chunked <= 1/4
of full) and its forward + backward time. ``--torch`` adds torch's own chunked
``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` (torch >= 2.13) as a third
variant, ``--repeat N`` runs the variants N times interleaved (medians reported), and a parity
check at a smaller shape ([512, 256] x [16384, 256]) compares each chunked variant's loss and
gradients (hidden and head, whole tensors) with full logits. Part 2 (``--recipes``): `recipes train` of a 1-layer Llama (hidden 128, tied, vocab
128256), seq 4096, one rank, 2 steps, peak RSS from metrics.jsonl, with each loss (target <= 2 GiB
with the default, chunked, loss).

    uv run --frozen python benchmarks/loss_memory.py [--torch] [--repeat N] [--recipes]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
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


def _loss(variant: str, hidden, weight, labels):
    """The summed token CE of ``hidden @ weight.T`` by `variant` (full, chunked: ours, torch)."""
    import torch.nn.functional as F

    from automodel.recipes.linear_ce import linear_cross_entropy_sum

    if variant == "full":
        return F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")
    if variant == "torch":
        from torch.nn import LinearCrossEntropyOptions  # torch >= 2.13

        # options=None would be torch's reference path (full logits); default options chunk
        return F.linear_cross_entropy(
            hidden, weight, labels, reduction="sum", options=LinearCrossEntropyOptions()
        )
    return linear_cross_entropy_sum(hidden, weight, labels)


def _loss_peak(variant: str, queue: mp.Queue) -> None:
    import torch

    torch.manual_seed(0)
    hidden = (torch.randn(TOKENS, HIDDEN) * 0.5).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN) * 0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (TOKENS,))
    base = _rss_bytes()
    started = time.perf_counter()
    loss = _loss(variant, hidden, weight, labels)
    loss.backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    grads = float(hidden.grad.norm()), float(weight.grad.norm())
    queue.put(
        {
            "variant": variant,
            "peak_bytes": peak - base,
            "loss": float(loss.detach()),
            "grads": grads,
            "s": seconds,
        }
    )


def loss_alone(variants: tuple[str, ...] = ("full", "chunked"), repeat: int = 1) -> dict[str, dict]:
    """Each variant `repeat` times, interleaved, in its own forked process; medians of peak and time."""
    ctx = mp.get_context("fork")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(repeat):
        for variant in variants:
            queue = ctx.Queue()
            proc = ctx.Process(target=_loss_peak, args=(variant, queue))
            proc.start()
            runs[variant].append(queue.get(timeout=1800))
            proc.join()
    results = {}
    for variant, rs in runs.items():
        results[variant] = {
            **rs[0],
            "peak_bytes": statistics.median(r["peak_bytes"] for r in rs),
            "s": statistics.median(r["s"] for r in rs),
            "all_s": [r["s"] for r in rs],
            "all_peak": [r["peak_bytes"] for r in rs],
        }
    return results


def parity(variants: tuple[str, ...], tokens: int = 512, hidden: int = 256, vocab: int = 16384) -> dict:
    """Relative difference of loss and of whole gradients (hidden, head) from full logits, fp32."""
    import torch

    torch.manual_seed(0)
    h0 = torch.randn(tokens, hidden) * 0.5
    w0 = torch.randn(vocab, hidden) * 0.02
    labels = torch.randint(0, vocab, (tokens,))
    labels[::7] = -100  # ignored tokens
    out = {}
    for variant in ("full", *variants):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = _loss(variant, h, w, labels)
        loss.backward()
        assert h.grad is not None and w.grad is not None
        out[variant] = (loss.detach(), h.grad, w.grad)
    ref = out.pop("full")

    def rel(a, b) -> float:
        return float((a - b).norm() / b.norm())

    return {
        v: {"loss": rel(x[0], ref[0]), "grad_hidden": rel(x[1], ref[1]), "grad_head": rel(x[2], ref[2])}
        for v, x in out.items()
    }


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
    parser.add_argument("--torch", action="store_true", help="also torch's F.linear_cross_entropy (chunked)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each variant, interleaved (medians)")
    args = parser.parse_args()
    variants = ("full", "chunked", "torch") if args.torch else ("full", "chunked")
    res = loss_alone(variants, repeat=args.repeat)
    full, chunked = res["full"], res["chunked"]
    print(
        f"loss alone, hidden [{TOKENS}, {HIDDEN}] x head [{VOCAB}, {HIDDEN}], fp32, forward + backward"
        f" (median of {args.repeat}):"
    )
    for name, r in res.items():
        print(
            f"  {name:>8}: peak +{r['peak_bytes'] / GIB:.2f} GiB, {r['s']:.2f} s, loss {r['loss']:.4f},"
            f" vs chunked: peak {r['peak_bytes'] / chunked['peak_bytes']:.2f}x, time {r['s'] / chunked['s']:.2f}x"
            + (f" (runs: {', '.join(f'{s:.2f}' for s in r['all_s'])} s)" if args.repeat > 1 else "")
        )
        if name != "full":
            rel = abs(r["loss"] - full["loss"]) / abs(full["loss"])
            gh = abs(r["grads"][0] - full["grads"][0]) / full["grads"][0]
            gw = abs(r["grads"][1] - full["grads"][1]) / full["grads"][1]
            print(
                f"            loss rel. diff {rel:.1e}, grad norms rel. diff hidden {gh:.1e}, head {gw:.1e}"
            )
    if args.repeat > 1:  # the same round's runs are closest in time: ratios per round, then the median
        for name, r in res.items():
            per_round = [s / c for s, c in zip(r["all_s"], chunked["all_s"], strict=True)]
            print(
                f"  {name:>8} / chunked time, median of per-round ratios: {statistics.median(per_round):.2f}x"
            )
    ratio = chunked["peak_bytes"] / full["peak_bytes"]
    print(f"  chunked / full peak = {ratio:.3f} (target <= 0.25)")
    print("parity at [512, 256] x [16384, 256], 1/7 of labels ignored, whole tensors vs full logits (rel.):")
    for name, r in parity(tuple(v for v in variants if v != "full")).items():
        print(f"  {name:>8}: " + ", ".join(f"{k} {x:.1e}" for k, x in r.items()))
    if args.recipes:
        print("recipes train, 1-layer Llama (hidden 128, tied, vocab 128256), seq 4096, 1 rank, 2 steps:")
        for name, fn in (("full", FULL), ("chunked", CHUNKED)):
            r = recipes_peak(fn)
            print(
                f"  {name:>8}: peak RSS {r['peak_bytes'] / GIB:.2f} GiB, losses {r['losses']} ({r['line']})"
            )


if __name__ == "__main__":
    main()
