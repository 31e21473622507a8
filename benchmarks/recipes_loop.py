"""Recipe-loop throughput vs a hand-written torch loop, and layouts vs 1 process (CPU, same run).

Measures tokens/s of `automodel.recipes.trainer.Trainer` on a tiny Llama against a minimal loop
(forward, mean CE, backward, AdamW step) on the same model and batches, then the recipe on
fsdp2 dp=2 and ddp dp=2 (2 forked gloo ranks) against its own 1-process figure. Prints ratios.

    uv run --frozen python benchmarks/recipes_loop.py [--steps 12]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from _recipe_config import llama, recipe_config

from automodel.recipes import load_config
from automodel.recipes.trainer import Trainer
from automodel.testing.ranks import run_on_ranks

CFG = recipe_config(
    model=llama(hidden=128, intermediate=344, layers=4, heads=4, kv_heads=2, max_positions=128),
    seq_length=128,
    max_bytes=400000,
    local_batch=4,
    global_batch=8,
)


def _cfg(steps: int, out: str, **dist) -> dict:
    c = copy.deepcopy(CFG)
    c["output_dir"] = out
    c["step_scheduler"]["max_steps"] = steps
    c["distributed"].update(dist)
    return c


def recipe_tokens_per_s(raw: dict) -> float:
    trainer = Trainer(load_config(raw))
    trainer.build()
    result = trainer.train()
    del result
    import json
    from pathlib import Path

    recs = [json.loads(x) for x in (Path(raw["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["tokens_per_s"] for r in recs[2:])


def plain_tokens_per_s(raw: dict) -> float:
    trainer = Trainer(load_config(raw))
    trainer.build()
    model = trainer.pm.parts[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rates = []
    for _ in range(raw["step_scheduler"]["max_steps"]):
        batches = trainer.loader.next_step()
        t0 = time.perf_counter()
        n = 0
        for b in batches:
            logits = model(input_ids=b.input_ids, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten()) / len(batches)
            loss.backward()
            n += b.labels.numel()
        opt.step()
        opt.zero_grad()
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates[2:])


def _rank_rate(raw: dict) -> float:
    return recipe_tokens_per_s(raw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        one = run_on_ranks(_rank_rate, world_size=1, args=(_cfg(args.steps, f"{d}/one"),), timeout_s=900)[0]
        plain = run_on_ranks(
            plain_tokens_per_s, world_size=1, args=(_cfg(args.steps, f"{d}/plain"),), timeout_s=900
        )[0]
        fsdp = run_on_ranks(_rank_rate, world_size=2, args=(_cfg(args.steps, f"{d}/fsdp"),), timeout_s=900)[0]
        ddp = run_on_ranks(
            _rank_rate, world_size=2, args=(_cfg(args.steps, f"{d}/ddp", strategy="ddp"),), timeout_s=900
        )[0]
    print(f"plain torch loop, 1 process      {plain:10.0f} tokens/s  (baseline)")
    print(f"recipe loop, 1 process            {one:10.0f} tokens/s  ratio {one / plain:.2f}")
    print(f"recipe fsdp2 dp=2 (2 ranks)       {fsdp:10.0f} tokens/s  ratio vs 1 process {fsdp / one:.2f}")
    print(f"recipe ddp dp=2 (2 ranks)         {ddp:10.0f} tokens/s  ratio vs 1 process {ddp / one:.2f}")


if __name__ == "__main__":
    main()
