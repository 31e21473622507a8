"""LoRA vs full fine-tuning of the same model and layout: per-rank memory and tokens/s (CPU, same run).

Trains a Llama (hidden 512, 4 layers, fp32, AdamW) through the recipes' own `Trainer` on fsdp2
dp=2 (2 forked gloo ranks), once with every weight trainable and once with ``peft:`` (LoRA dim 8 on
every ``*_proj``), and prints per rank: parameter, gradient and optimizer-state bytes this rank
holds (measured on the live tensors after the last step, plus one more backward so gradients
exist), the peak growth of the rank's resident set over its start (parameters, gradients, optimizer
state, activations; Linux), and the median tokens/s of the timed steps; then the LoRA / full ratios.

    uv run --frozen python benchmarks/lora_vs_full.py [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import torch
from _recipe_config import llama, recipe_config
from torch.distributed.tensor import DTensor

from automodel.testing.ranks import run_on_ranks

MODEL = llama(hidden=512, intermediate=1376, layers=4, heads=8, kv_heads=4, max_positions=256)
LORA = {"dim": 8, "alpha": 16}  # target_modules: "*_proj" (NeMo's default)


def raw_config(out: str, *, steps: int, lora: bool) -> dict:
    raw = recipe_config(
        model=MODEL,
        seq_length=256,
        max_bytes=600_000,
        local_batch=4,
        global_batch=8,
        steps=steps,
        output_dir=out,
        fp32=True,
    )
    if lora:
        raw["peft"] = dict(LORA)
    return raw


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _current_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(raw: dict, warmup: int) -> dict[str, float]:
    from automodel.recipes import load_config
    from automodel.recipes.trainer import Trainer

    rss_start = _current_rss()
    trainer = Trainer(load_config(raw))
    trainer.build()
    rates = []
    for step in range(trainer.total_steps):
        trainer.step = step
        batches = trainer.loader.next_step()
        started = time.perf_counter()
        tokens = int(trainer.train_step(batches).tokens)  # waits for the step
        if step >= warmup:
            rates.append(tokens / (time.perf_counter() - started))
    tokens_t = torch.tensor(float(max(1, int((batches[0].labels != -100).sum()))))
    trainer._micro_batch_loss(batches[0], divisor=tokens_t, backward=True)  # gradients to measure
    params = [p for part in trainer.pm.parts for p in part.parameters()]
    opt_bytes = sum(
        _local_bytes(v)
        for opt in trainer.optimizers
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    return {
        "param": sum(_local_bytes(p) for p in params),
        "trainable": sum(_local_bytes(p) for p in params if p.requires_grad),
        "grad": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": opt_bytes,
        # growth of the resident set over the forked rank's start (imports are shared with the parent)
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_start,
        "tokens_per_s": statistics.median(rates),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, lora in (("full", False), ("lora", True)):
            raw = raw_config(f"{tmp}/{name}", steps=a.steps, lora=lora)
            results[name] = run_on_ranks(measure, world_size=2, args=(raw, a.warmup), timeout_s=900)
    mib = 2**20
    print("fsdp2 dp=2, Llama hidden 512 x 4 layers, seq 256, local batch 4, fp32 AdamW; per rank:")
    print(
        f"{'run':>5} {'rank':>4} {'param MiB':>10} {'trainable MiB':>14} {'grad MiB':>9} {'optim MiB':>10} "
        f"{'p+g+o MiB':>10} {'peak RSS+ MiB':>13} {'tokens/s':>9}"
    )
    for name, per_rank in results.items():
        for rank, m in enumerate(per_rank):
            total = m["param"] + m["grad"] + m["optimizer"]
            print(
                f"{name:>5} {rank:>4} {m['param'] / mib:>10.2f} {m['trainable'] / mib:>14.3f} "
                f"{m['grad'] / mib:>9.3f} {m['optimizer'] / mib:>10.3f} {total / mib:>10.2f} "
                f"{m['peak_rss'] / mib:>13.0f} {m['tokens_per_s']:>9.0f}"
            )

    def worst(name: str, key: str) -> float:
        if key == "p+g+o":
            return max(m["param"] + m["grad"] + m["optimizer"] for m in results[name])
        if key == "tokens_per_s":
            return min(m[key] for m in results[name])
        return max(m[key] for m in results[name])

    for key in ("p+g+o", "peak_rss", "tokens_per_s"):
        print(f"lora / full {key}: {worst('lora', key) / worst('full', key):.3f}")


if __name__ == "__main__":
    main()
