"""Planning a 16,384-rank job in one process through torch's fake process-group backend."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from automodel.mesh import MeshContext, ParallelismSizes, fake_world

SIZES = ParallelismSizes(pp_size=8, tp_size=8, cp_size=2, ep_size=8)
WORLD = 16_384


@pytest.mark.parametrize("rank", [0, 5_000, 12_345, WORLD - 1])
def test_sixteen_k_rank_layout_groups(rank: int) -> None:
    with fake_world(WORLD, rank=rank):
        ctx = MeshContext.build(SIZES, device_type="cpu")
        layout = ctx.layout
        assert (layout.pp, layout.dp, layout.dp_shard, layout.cp, layout.tp) == (8, 128, 128, 2, 8)
        assert (layout.ep, layout.ep_shard, layout.dp_cp) == (8, 32, 256)
        for axis in layout.axis_names():
            mesh = ctx.get_mesh(axis)
            assert mesh.size() == layout.axis_size(axis), axis
            members = dist.get_process_group_ranks(mesh.get_group())
            assert members == layout.group_ranks(rank, axis), axis
            assert rank in members
        assert ctx.coordinates == layout.coordinates(rank)


def test_layout_arithmetic_is_consistent_for_every_rank_of_a_big_world() -> None:
    layout = SIZES.resolve(WORLD)
    seen = set()
    for rank in range(0, WORLD, 97):
        c = layout.coordinates(rank)
        key = (c["pp"], c["dp_replicate"], c["dp_shard"], c["cp"], c["tp"])
        assert key not in seen
        seen.add(key)
        tp_group = layout.group_ranks(rank, "tp")
        assert len(tp_group) == 8 and rank in tp_group and tp_group == sorted(tp_group)
        ep_group = layout.group_ranks(rank, "ep")
        assert len(ep_group) == 8 and rank in ep_group
        # experts of one ep group share pp stage and tp coordinate
        assert {layout.coordinates(r)["pp"] for r in ep_group} == {c["pp"]}
        assert {layout.coordinates(r)["tp"] for r in ep_group} == {c["tp"]}


def test_fake_world_rejects_a_rank_outside_it() -> None:
    with pytest.raises(ValueError, match="rank 8 is outside world_size 8"):
        with fake_world(8, rank=8):
            pass
