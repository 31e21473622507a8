"""Time to build and check the layout of a 16,384-rank job in one process (target: < 10 s).

Baseline measured in the same run: torch's bare `init_device_mesh` of the same dense shape, which
calls `new_group` for every group of every rank (as each real rank must). In a fake world
MeshContext creates only the planned rank's group of each axis (`automodel.mesh.planned`), then the
flattened axes and the MoE mesh, and checks every axis group against the layout's arithmetic;
a ratio below 1 is that saving.

    uv run --frozen python benchmarks/mesh_planning.py
"""

from __future__ import annotations

import time

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from automodel.mesh import MeshContext, ParallelismSizes, dense_axes, fake_world

SIZES = ParallelismSizes(pp_size=8, tp_size=8, cp_size=2, ep_size=8)
WORLD = 16_384
SAMPLED_RANKS = (0, 5_000, 12_345, WORLD - 1)


def plan_and_check(rank: int) -> None:
    with fake_world(WORLD, rank=rank):
        ctx = MeshContext.build(SIZES, device_type="cpu")
        for axis in ctx.layout.axis_names():
            members = dist.get_process_group_ranks(ctx.get_mesh(axis).get_group())
            assert members == ctx.layout.group_ranks(rank, axis), axis


def bare_torch_mesh(rank: int) -> None:
    with fake_world(WORLD, rank=rank):
        init_device_mesh("cpu", SIZES.resolve(WORLD).dense_shape, mesh_dim_names=dense_axes())


def timed(fn, rank: int) -> float:
    start = time.perf_counter()
    fn(rank)
    return time.perf_counter() - start


def main() -> None:
    ours = [timed(plan_and_check, r) for r in SAMPLED_RANKS]
    base = [timed(bare_torch_mesh, r) for r in SAMPLED_RANKS]
    print(f"layout: {SIZES.resolve(WORLD).describe()}")
    print(f"{'rank':>6} {'MeshContext+checks s':>22} {'bare init_device_mesh s':>24} {'ratio':>6}")
    for r, a, b in zip(SAMPLED_RANKS, ours, base):
        print(f"{r:>6} {a:>22.3f} {b:>24.3f} {a / b:>6.2f}")
    worst = max(ours)
    print(f"worst {worst:.3f} s per planned rank (target < 10 s): {'PASS' if worst < 10 else 'MISS'}")


if __name__ == "__main__":
    main()
