"""Ring attention under CP: peak attention memory per rank and step time vs one rank.

For each total sequence length and cp in (1, 2, 4), forks cp gloo ranks; each runs forward +
backward of `ring_attention` on its S/cp load-balanced tokens and reports
  * peak attention memory: the peak of live tensor bytes (torch's MemTracker, which counts
    every tensor allocated under it) during forward + backward, q/k/v/grad inputs included;
  * step time: wall time of forward + backward (max over ranks, median of repeats).
cp=1 is the single-rank attention of the same total length (same kernel), the baseline for
both ratios. Run: uv run --frozen python benchmarks/cp_memory.py [--seq 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # noqa: F401  (imported once here, not in every forked rank)
from torch.distributed._tools.mem_tracker import MemTracker

from automodel.context_parallel import load_balanced_indices, ring_attention
from automodel.testing.ranks import run_on_ranks

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


def _rank(seq_len: int, rotation: str, repeats: int) -> tuple[float, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    index = load_balanced_indices(seq_len, cp_size=world, cp_rank=rank)
    s = seq_len // world
    torch.manual_seed(rank)
    q = torch.randn(1, HEADS, s, HEAD_DIM, requires_grad=True)
    k = torch.randn(1, KV_HEADS, s, HEAD_DIM, requires_grad=True)
    v = torch.randn(1, KV_HEADS, s, HEAD_DIM, requires_grad=True)
    grad = torch.randn(1, HEADS, s, HEAD_DIM)

    def step():
        out = ring_attention(q, k, v, cp_group=dist.group.WORLD, token_index=index, kv_rotation=rotation)
        out.backward(grad)

    step()  # warm-up
    tracker = MemTracker()
    tracker.track_external(q, k, v, grad)
    with tracker:
        step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        elapsed = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return peak / 2**20, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rotation", choices=["allgather", "p2p"], nargs="+", default=["allgather", "p2p"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"heads={HEADS} kv_heads={KV_HEADS} head_dim={HEAD_DIM} batch=1 fp32, forward+backward, gloo CPU")
    print(
        f"{'seq':>6} {'rotation':>9} {'cp':>3} {'peak MiB/rank':>14} {'mem vs cp=1':>12} {'step s':>8} {'time vs cp=1':>13}"
    )
    for seq_len in args.seq:
        for rotation in args.rotation:
            base_mem = base_time = None
            for cp in args.cp:
                results = run_on_ranks(
                    _rank, world_size=cp, args=(seq_len, rotation, args.repeats), timeout_s=1800
                )
                mem = max(r[0] for r in results)
                step = results[0][1]
                if cp == 1 or base_mem is None:
                    base_mem, base_time = mem, step
                print(
                    f"{seq_len:>6} {rotation:>9} {cp:>3} {mem:>14.1f} {mem / base_mem:>12.3f} "
                    f"{step:>8.3f} {step / base_time:>13.3f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
