"""A plugin's own mesh axis, added by one `register_axis` call from this file alone: the sizes, the
layout's rank arithmetic and a real gloo mesh take it with no edit of `automodel.mesh`.

The toy axis ``sq`` is an Ulysses-style sequence axis: its ranks hold a slice of the sequence and
swap it for a slice of the heads with one all-to-all, which must give exactly the full tensor's
head slice.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from automodel.mesh import (
    Axis,
    MeshContext,
    ParallelismSizes,
    ResolvedLayout,
    dense_axes,
    flattened_axes,
    parallel_axes,
    register_axis,
    unregister_axis,
)
from automodel.testing.ranks import run_on_ranks

SEQ, HEADS, DIM = 8, 4, 3


@pytest.fixture
def toy_axis() -> Iterator[None]:
    register_axis(Axis("sq", "dense", size_key="sq_size", model_parallel=True), before="tp")
    try:
        yield
    finally:
        unregister_axis("sq")


def test_the_sizes_and_the_layout_take_a_registered_axis(toy_axis: None) -> None:
    assert dense_axes() == ("pp", "dp_replicate", "dp_shard", "cp", "sq", "tp")
    assert "sq" in parallel_axes()
    layout = ParallelismSizes(sq_size=2, tp_size=2).resolve(8)
    assert (layout.sq, layout.tp, layout.dp_shard, layout.axis_size("sq")) == (2, 2, 2, 2)
    assert layout.dense_shape == (1, 1, 2, 1, 2, 2)
    assert "sq=2" in layout.describe()
    # sq sits just outside tp: its ranks are tp (2) ranks apart, and dp_shard spans sq*tp = 4
    assert layout.group_ranks(1, "sq") == [1, 3]
    assert layout.group_ranks(1, "dp_shard") == [1, 5]
    assert layout.coordinates(3) == {
        "pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "sq": 1, "tp": 1, "ep_shard": 0, "ep": 0,
    }  # fmt: skip
    with pytest.raises(
        ValueError, match=r"world_size 6 is not divisible by pp_size\*cp_size\*sq_size\*tp_size = 4"
    ):
        ParallelismSizes(sq_size=2, tp_size=2).resolve(6)
    with pytest.raises(ValueError, match="sq_size must be >= 1, got 0"):
        ParallelismSizes(sq_size=0)
    with pytest.raises(ValueError, match="registered twice"):
        register_axis(Axis("sq", "dense", size_key="other_size", model_parallel=True), before="tp")


def test_an_unregistered_axis_is_unknown() -> None:
    assert "sq" not in dense_axes()
    with pytest.raises(TypeError, match=r"unknown size keys \['sq_size'\]"):
        ParallelismSizes(sq_size=2)
    with pytest.raises(TypeError, match=r"unknown axes \['sq'\]"):
        ResolvedLayout(world_size=2, sq=2)


def test_only_a_dense_model_parallel_axis_can_be_registered() -> None:
    with pytest.raises(ValueError, match="only a dense, model-parallel axis"):
        register_axis(Axis("moe2", "moe", size_key="moe2_size"), before="tp")
    with pytest.raises(ValueError, match="before='ep' is not a dense axis"):
        register_axis(Axis("sq", "dense", size_key="sq_size", model_parallel=True), before="ep")
    with pytest.raises(ValueError, match="is built in"):
        unregister_axis("tp")


def _full() -> torch.Tensor:
    return torch.arange(SEQ * HEADS * DIM, dtype=torch.float32).reshape(SEQ, HEADS, DIM)


def _sequence_to_heads(sizes: ParallelismSizes) -> dict[str, object]:
    """Each rank's sq group swaps sequence slices for head slices with one all-to-all."""
    ctx = MeshContext.build(sizes)
    mesh = ctx.get_mesh("sq")
    group = mesh.get_group()
    n, index = mesh.size(), mesh.get_local_rank()
    mine = _full().chunk(n, dim=0)[index]  # [SEQ/n, HEADS, DIM]
    send = [c.contiguous() for c in mine.chunk(n, dim=1)]  # head slice j goes to sq rank j
    recv = [torch.empty_like(send[0]) for _ in range(n)]
    dist.all_to_all(recv, send, group=group)
    got = torch.cat(recv, dim=0)  # [SEQ, HEADS/n, DIM]
    return {
        "members": dist.get_process_group_ranks(group),
        "expected_members": ctx.layout.group_ranks(dist.get_rank(), "sq"),
        "exact": torch.equal(got, _full().chunk(n, dim=1)[index]),
        "describe": ctx.layout.describe(),
    }


def test_a_registered_axis_forms_real_groups_that_swap_sequence_for_heads(toy_axis: None) -> None:
    results = run_on_ranks(
        _sequence_to_heads, world_size=4, args=(ParallelismSizes(sq_size=2, tp_size=2),), timeout_s=120
    )
    for rank, r in enumerate(results):
        assert r["members"] == r["expected_members"], rank
        assert r["exact"], rank
        assert "sq=2 tp=2" in str(r["describe"])
    assert [r["members"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_an_axis_holding_replicas_joins_the_parameter_sharding_axes() -> None:
    """A registered axis whose ranks hold the same parameters (as cp's) joins ``dp_shard_cp`` (FSDP's
    shard group) and ``dp_cp``: their sizes, rank groups and the expert split take it in."""
    register_axis(
        Axis("sq", "dense", size_key="sq_size", model_parallel=True, holds_replicas=True), before="tp"
    )
    try:
        assert flattened_axes()["dp_shard_cp"] == ("dp_shard", "cp", "sq")
        assert flattened_axes()["dp_cp"] == ("dp_replicate", "dp_shard", "cp", "sq")
        layout = ParallelismSizes(sq_size=2, tp_size=2).resolve(8)
        assert (layout.dp_shard_cp, layout.dp_cp, layout.fsdp_enabled) == (4, 4, True)
        assert layout.group_ranks(1, "dp_shard_cp") == [1, 3, 5, 7]
        with pytest.raises(
            ValueError, match=r"dp_size\*cp_size\*sq_size = 4 \(dp_size=2, cp_size=1, sq_size=2\)"
        ):
            ParallelismSizes(sq_size=2, ep_size=3).resolve(4)
    finally:
        unregister_axis("sq")
    assert flattened_axes()["dp_shard_cp"] == ("dp_shard", "cp")


def _groups_over(sizes: ParallelismSizes) -> dict[str, object]:
    ctx = MeshContext.build(sizes)
    rank, layout = dist.get_rank(), ctx.layout
    coords = [layout.coordinates(r) for r in range(layout.world_size)]
    spanned = ("dp_shard", "sq")  # no flattened axis spans exactly these: made on the first call
    fixed = [a for a in dense_axes() if a not in spanned]
    mesh = ctx.mesh_over(spanned)
    assert mesh is not None and ctx.mesh_over(spanned) is mesh  # made once
    single = ctx.mesh_over(("dp_replicate", "dp_shard", "cp"))  # dp_replicate and cp hold one rank
    assert single is not None
    return {
        "members": dist.get_process_group_ranks(mesh.get_group()),
        "expected": [
            r for r in range(layout.world_size) if all(coords[r][a] == coords[rank][a] for a in fixed)
        ],
        "single": dist.get_process_group_ranks(single.get_group()),
        "dp_shard": layout.group_ranks(rank, "dp_shard"),
        "none": ctx.mesh_over(("pp", "cp")),
    }


def test_a_mesh_over_axes_no_flattened_axis_spans_is_made_once(toy_axis: None) -> None:
    results = run_on_ranks(_groups_over, world_size=4, args=(ParallelismSizes(sq_size=2),), timeout_s=120)
    for rank, r in enumerate(results):
        assert r["members"] == r["expected"] == [0, 1, 2, 3], rank
        assert len(r["single"]) == 2, rank
        assert r["single"] == r["dp_shard"], rank
        assert r["none"] is None
