"""Fake-world meshes are built from the planned rank's own groups only (`automodel.mesh.planned`):
they must hold exactly the groups torch's `init_device_mesh` gives that rank, for every layout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from automodel.mesh import MeshContext, ParallelismSizes, dense_axes, fake_world, flattened_axes, moe_axes
from automodel.mesh.planned import own_group_ranks, rank_grid

from .layouts import legal_layouts

WORLD = 8


def _torch_meshes(ctx: MeshContext) -> dict[str, DeviceMesh]:
    """The 1-D meshes of every axis as torch builds them (one new_group per group of every rank)."""
    layout = ctx.layout
    dense = init_device_mesh("cpu", layout.dense_shape, mesh_dim_names=dense_axes())
    out = {axis: dense[axis] for axis in dense_axes()}
    out.update({name: dense[axes]._flatten(name) for name, axes in flattened_axes().items()})
    if layout.ep_enabled:
        ranks = torch.arange(layout.world_size).reshape(layout.moe_shape)
        moe = DeviceMesh("cpu", ranks, mesh_dim_names=(*moe_axes(), "moe_tp"))
        out.update({axis: moe[axis] for axis in ("ep_shard", "ep")})
    return out


@pytest.mark.parametrize("rank", [0, 5, WORLD - 1])
def test_own_groups_match_torch_for_every_layout(rank: int) -> None:
    problems = []
    with fake_world(WORLD, rank=rank):
        for sizes in legal_layouts(WORLD):
            ctx = MeshContext.build(sizes, device_type="cpu")
            for axis, reference in _torch_meshes(ctx).items():
                mesh = ctx.get_mesh(axis)
                got = dist.get_process_group_ranks(mesh.get_group())
                want = dist.get_process_group_ranks(reference.get_group())
                if got != want or got != ctx.layout.group_ranks(rank, axis):
                    problems.append(f"{sizes} rank {rank} {axis}: {got} != torch {want}")
                if mesh.mesh.tolist() != reference.mesh.tolist():
                    problems.append(
                        f"{sizes} rank {rank} {axis}: mesh {mesh.mesh.tolist()} != {reference.mesh.tolist()}"
                    )
    assert not problems, "\n".join(problems[:20])


def test_own_group_ranks_of_a_grid() -> None:
    grid = rank_grid((2, 3, 4))
    assert own_group_ranks(grid, 17) == [[5, 17], [13, 17, 21], [16, 17, 18, 19]]


def test_sixteen_k_ranks_create_only_the_planned_ranks_groups() -> None:
    """39,040 new_group calls (one per group of every rank) took ~1.5 s at this size; now the dense
    and MoE meshes make one group per axis and only torch's flattening loops (world/size groups)."""
    sizes = ParallelismSizes(pp_size=4, tp_size=8, ep_size=8)
    with fake_world(16_384, rank=12_345):
        before = distributed_c10d._world.group_count
        ctx = MeshContext.build(sizes, device_type="cpu")
        created = distributed_c10d._world.group_count - before
        layout = ctx.layout
        flattening = sum(layout.world_size // layout.axis_size(name) for name in flattened_axes())
        assert created == len(dense_axes()) + len(moe_axes()) + 1 + flattening


def test_a_group_that_disagrees_with_the_layout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from automodel.mesh import planned

    def wrong_tp_group(grid: torch.Tensor, rank: int) -> list[list[int]]:
        groups = own_group_ranks(grid, rank)
        groups[-1] = [1, 3]  # rank 1's tp partner is rank 0
        return groups

    monkeypatch.setattr(planned, "own_group_ranks", wrong_tp_group)
    with fake_world(8, rank=1), pytest.raises(RuntimeError, match="rank 1: the tp group holds ranks"):
        MeshContext.build(ParallelismSizes(tp_size=2, pp_size=2), device_type="cpu")
