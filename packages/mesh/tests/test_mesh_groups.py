"""Every legal layout of 1, 2, 4 and 8 ranks: each axis group holds exactly the expected ranks.

Each rank all-gathers its rank over every axis group of a real gloo mesh and compares with the
pure rank arithmetic of `ResolvedLayout.group_ranks`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.testing.ranks import run_on_ranks

from .layouts import legal_layouts

BATCH = 8


def _gather_over(group: dist.ProcessGroup, size: int) -> list[int]:
    mine = torch.tensor([dist.get_rank()])
    out = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return [int(t) for t in out]


def _check_layouts(layouts: list[ParallelismSizes]) -> list[str]:
    """Return a list of mismatch descriptions (empty when every group is right)."""
    rank = dist.get_rank()
    problems = []
    for sizes in layouts:
        ctx = MeshContext.build(sizes)
        for axis in ctx.layout.axis_names():
            if axis in ("ep", "ep_shard") and not ctx.ep_enabled:
                assert ctx.get_optional_mesh(axis) is None
                continue
            mesh = ctx.get_mesh(axis)
            expected = ctx.layout.group_ranks(rank, axis)
            if mesh.size() != ctx.size(axis):
                problems.append(f"{sizes} {axis}: mesh size {mesh.size()} != {ctx.size(axis)}")
            got = _gather_over(mesh.get_group(), mesh.size())
            if got != expected:
                problems.append(f"{sizes} rank {rank} {axis}: group {got} != expected {expected}")
            if (ctx.get_optional_mesh(axis) is None) != (
                ctx.size(axis) == 1 or axis.startswith("ep") and not ctx.ep_enabled
            ):
                problems.append(f"{sizes} {axis}: get_optional_mesh disagrees with size {ctx.size(axis)}")
        assert ctx.coordinates == ctx.layout.coordinates(rank)
    return problems


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_every_legal_layout_has_the_expected_groups(world_size: int) -> None:
    layouts = legal_layouts(world_size)
    problems: list[str] = []
    # Fresh ranks every few layouts: each mesh opens gloo sockets, and 68 meshes at once exhaust fds.
    for start in range(0, len(layouts), BATCH):
        batch = layouts[start : start + BATCH]
        results = run_on_ranks(_check_layouts, world_size=world_size, args=(batch,), timeout_s=300)
        problems += [p for per_rank in results for p in per_rank]
    assert not problems, "\n".join(problems[:20])
