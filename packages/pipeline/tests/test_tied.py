"""Tied weights across stages: ranks that disagree on their copies fail together, never hang.

A rank that misses its copy of a tied weight (its stage knows the weight by another name) once
skipped the shape check's collective while its peer waited in it, and the run hung. The check is
now one gather over the world, so every rank raises the same error.
"""

from __future__ import annotations

import torch
from torch import nn

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.pipeline.tied import TiedParameters
from automodel.testing.ranks import run_on_ranks


class _Stage(nn.Module):
    def __init__(self, stage_index: int, attr: str) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.add_module(attr, nn.Linear(4, 8, bias=False))


def _build(first_attr: str, last_attr: str) -> str:
    mesh = MeshContext.build(ParallelismSizes(pp_size=2))
    me = mesh.get_mesh("pp").get_local_rank()
    part = _Stage(me, first_attr if me == 0 else last_attr)
    try:
        tied = TiedParameters.build(
            mesh=mesh,
            holders={"embed.weight": [0, 1]},
            stage_ids_per_rank={0: [0], 1: [1]},
            model_parts=[part],
        )
    except ValueError as err:
        return f"ValueError: {err}"
    weight = part.get_parameter(f"{first_attr if me == 0 else last_attr}.weight")
    weight.grad = torch.full((8, 4), me + 1.0)
    tied.sync_gradients()
    return f"ok {tied.names} {weight.grad[0, 0]}"


def test_matching_copies_sum_gradients() -> None:
    results = run_on_ranks(_build, world_size=2, args=("embed", "embed"), timeout_s=60)
    assert results == ["ok ['embed.weight'] 3.0"] * 2


def test_a_missing_copy_fails_on_every_rank() -> None:
    # The last stage holds the weight as head.weight, not embed.weight: both ranks raise.
    results = run_on_ranks(_build, world_size=2, args=("embed", "head"), timeout_s=60)
    for result in results:
        assert result.startswith(
            "ValueError: rank 1 runs a pipeline stage holding the tied weight embed.weight"
        )
