"""Per-rank parameter + gradient + optimizer bytes under fsdp2 vs world size, and vs `recipes validate`.

Targets: the measured per-rank total within 5% of (1-rank total)/dp, and within 10% of the estimate
that `recipes validate` prints for the same config and world size. Measured on real gloo ranks through
the recipes' own Trainer (build, one optimizer step, one more backward so gradients exist).

    uv run --frozen python benchmarks/memory.py [--worlds 1 2 4 8]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _recipe_config import llama, recipe_config
from torch.distributed.tensor import DTensor

from automodel.testing.ranks import run_on_ranks

MODEL = llama(hidden=256, intermediate=688, layers=4, heads=8, kv_heads=4, max_positions=128)


def raw_config(out: str, world: int) -> dict:
    return recipe_config(
        model=MODEL,
        seq_length=64,
        max_bytes=200_000,
        local_batch=2,
        global_batch=2 * world,
        steps=2,
        output_dir=out,
        fp32=True,
    )


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def measure(raw: dict) -> dict[str, int]:
    from automodel.recipes import load_config
    from automodel.recipes.trainer import Trainer

    trainer = Trainer(load_config(raw))
    trainer.build()
    batches = trainer.loader.next_step()
    trainer.step = 0
    trainer.train_step(batches)  # creates the optimizer state
    tokens = torch.tensor(float(max(1, int((batches[0].labels != -100).sum()))))
    trainer._micro_batch_loss(batches[0], divisor=tokens, backward=True)
    params = [p for part in trainer.pm.parts for p in part.parameters()]
    opt_bytes = sum(
        _local_bytes(v) for opt in trainer.optimizers for st in opt.state.values() for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )  # fmt: skip
    return {
        "param": sum(_local_bytes(p) for p in params),
        "grad": sum(_local_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer": opt_bytes,
    }


def estimate(raw: dict, world: int) -> float:
    from automodel.mesh import fake_world  # noqa: F401  (plan_layout uses it)
    from automodel.recipes import load_config
    from automodel.recipes.plan import plan_layout

    _, mem, _ = plan_layout(load_config(raw), world_size=world)
    return mem.total_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8])
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in a.worlds:
            raw = raw_config(tmp, world)
            per_rank = run_on_ranks(measure, world_size=world, args=(raw,), timeout_s=900)
            worst = max(per_rank, key=lambda m: sum(m.values()))
            rows.append((world, worst, estimate(raw, world)))
    single = sum(rows[0][1].values()) * rows[0][0]  # world 1 total (or scaled if 1 not measured)
    print(f"{'world':>5} {'param MiB':>10} {'grad MiB':>9} {'optim MiB':>10} {'total MiB':>10} "
          f"{'x dp / 1-rank':>14} {'validate est MiB':>17} {'measured/est':>13}")  # fmt: skip
    for world, m, est in rows:
        total = sum(m.values())
        print(
            f"{world:>5} {m['param'] / 2**20:>10.2f} {m['grad'] / 2**20:>9.2f} {m['optimizer'] / 2**20:>10.2f} "
            f"{total / 2**20:>10.2f} {total * world / single:>14.3f} {est / 2**20:>17.2f} {total / est:>13.3f}"
        )
    print("targets: 'x dp / 1-rank' within 1 +- 0.05; 'measured/est' within 1 +- 0.10")


if __name__ == "__main__":
    main()
