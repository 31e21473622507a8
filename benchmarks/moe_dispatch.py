"""Expert-parallel dispatch cost: bytes moved per step vs the minimum, and step time for ep=1, 2, 4.

Same tiny Mixtral, same global batch, 4 gloo ranks (FSDP2 over all of them; ep=1 keeps every
expert on every rank). Bytes: every (token, top-k slot) whose expert lives on another rank crosses
the network in dispatch and again in combine, forward and backward; the minimum sends each token
once per distinct remote owner (a dispatcher that de-duplicates slots landing on the same rank).

    uv run --frozen python benchmarks/moe_dispatch.py [--steps 6] [--seq 64] [--hidden 128]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

from automodel.fsdp2 import FSDP2Config
from automodel.mesh import MeshContext, ParallelismSizes
from automodel.moe import MoEParallelizerConfig, find_moe_blocks
from automodel.recipes.strategies.fsdp2 import apply_fsdp2_stack
from automodel.testing.moe import build_tiny_model, preload
from automodel.testing.ranks import run_on_ranks

WORLD, VOCAB, EXPERTS, TOP_K = 4, 256, 8, 2


def _rank(ep: int, steps: int, seq: int, hidden: int, layers: int) -> dict:
    ctx = MeshContext.build(ParallelismSizes(ep_size=ep))
    model = build_tiny_model(
        "mixtral", num_experts=EXPERTS, top_k=TOP_K, layers=layers, hidden=hidden, expert_intermediate=hidden
    )
    routing: list[torch.Tensor] = []
    for block in find_moe_blocks(model):
        block.experts.register_forward_pre_hook(lambda _m, args: routing.append(args[1].detach()))
    apply_fsdp2_stack(  # the FSDP2 strategy's stack, as the recipes run it
        model,
        mesh=ctx,
        config=FSDP2Config(mp_policy=MixedPrecisionPolicy()),
        moe_config=MoEParallelizerConfig(),
        gradient_divide_factor=1.0,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    times, moved, minimum = [], 0, 0
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (WORLD * 2, seq), generator=g).chunk(WORLD)[rank]
        routing.clear()
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(input_ids=ids).logits
        F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        if ep > 1 and step == 0:
            ep_rank, local = ctx.coordinates["ep"], EXPERTS // ep
            for idx in routing:
                owner = idx // local
                remote = owner != ep_rank
                moved += int(remote.sum())
                # distinct remote owners per token
                minimum += sum(len(set(row) - {ep_rank}) for row in owner.tolist())
    row_bytes = hidden * 4  # fp32 activations
    # dispatch + combine, forward + backward
    stats = torch.tensor([moved * row_bytes * 4, minimum * row_bytes * 4], dtype=torch.float64)
    dist.all_reduce(stats)
    return {
        "step_s": sorted(times[1:])[len(times[1:]) // 2],
        "bytes": stats[0].item(),
        "min_bytes": stats[1].item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    preload(("mixtral",))
    rows = {}
    for ep in (1, 2, 4):
        res = run_on_ranks(
            _rank, world_size=WORLD, args=(ep, args.steps, args.seq, args.hidden, args.layers), timeout_s=600
        )
        rows[ep] = {
            "step_s": max(r["step_s"] for r in res),
            "bytes": res[0]["bytes"],
            "min_bytes": res[0]["min_bytes"],
        }
    base = rows[1]["step_s"]
    print(
        f"world={WORLD} mixtral E={EXPERTS} top_k={TOP_K} hidden={args.hidden} seq={args.seq} layers={args.layers}"
    )
    print("ep | step_s (median) | vs ep=1 | a2a bytes/step (all ranks) | minimum | moved/min")
    for ep, r in rows.items():
        ratio = r["bytes"] / r["min_bytes"] if r["min_bytes"] else float("nan")
        print(
            f"{ep:2d} | {r['step_s']:.4f} | {r['step_s'] / base:.2f}x | {r['bytes']:.0f} | {r['min_bytes']:.0f} | {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
