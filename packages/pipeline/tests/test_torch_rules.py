"""Layouts a torch release cannot set up on a backend are refused before any stage is built."""

from __future__ import annotations

import pytest
from torch import nn

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline import AutoPipeline, PipelineConfig
from automodel.pipeline.layout import check_adjacent_stages_on_one_rank, stage_ids_this_rank
from automodel.testing.ranks import RankFailure, run_on_ranks
from automodel.testing.torch_rules import v_schedules_run_on_gloo

V_LAYOUT = {r: stage_ids_this_rank(pp_rank=r, pp_size=2, num_stages=4, v_shape=True) for r in range(2)}
ROUND_ROBIN = {r: stage_ids_this_rank(pp_rank=r, pp_size=2, num_stages=4) for r in range(2)}


def test_adjacent_stages_on_one_rank_are_refused_on_torch_2_11_with_gloo() -> None:
    with pytest.raises(
        ValueError, match=r"pp rank 1 holds the adjacent stages 1 and 2 .*torch 2\.11\.0.*gloo"
    ):
        check_adjacent_stages_on_one_rank(V_LAYOUT, backend="gloo", torch_version="2.11.0+cu130")


@pytest.mark.parametrize(
    ("layout", "backend", "version"),
    [
        (V_LAYOUT, "gloo", "2.12.1"),
        (V_LAYOUT, "gloo", "2.15.0"),
        (V_LAYOUT, "nccl", "2.11.0"),
        (ROUND_ROBIN, "gloo", "2.11.0"),
    ],
)
def test_other_layouts_backends_and_releases_are_accepted(layout: dict, backend: str, version: str) -> None:
    check_adjacent_stages_on_one_rank(layout, backend=backend, torch_version=version)


def _build_zbv() -> list[int]:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    config = PipelineConfig(
        pp_schedule="zbv",
        pp_batch_size=4,
        pp_microbatch_size=1,
        module_fqns_per_model_part=[["0"], ["1"], ["2"], ["3"]],
    )
    return (
        AutoPipeline(mesh=mesh, config=config)
        .build(model, loss_fn=lambda o, t: (o - t).pow(2).sum())
        .stage_ids
    )


def test_the_installed_torch_builds_or_refuses_a_v_schedule_on_gloo() -> None:
    """On torch 2.11 the build is refused on every rank with the rule's message; elsewhere it builds."""
    if v_schedules_run_on_gloo():
        assert run_on_ranks(_build_zbv, world_size=2) == [[0, 3], [1, 2]]
    else:
        with pytest.raises(RankFailure, match="adjacent stages"):
            run_on_ranks(_build_zbv, world_size=2)
