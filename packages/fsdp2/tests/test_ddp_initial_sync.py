"""DDP starts every rank from the first rank's parameters and buffers, broadcast in place.

The sync makes no flattened copy (whose release on gloo's worker thread the allocator profiler
cannot see), and ranks that built different shapes get an error naming the mismatch, not a hang.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from automodel.testing.ranks import run_on_ranks


def _model(width: int) -> nn.Module:
    model = nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
    model.register_buffer("scale", torch.zeros(width))
    return model


def _sync_on_rank(width_by_rank: list[int]) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from automodel.fsdp2 import apply_ddp
    from automodel.mesh import MeshContext, ParallelismSizes

    rank = dist.get_rank()
    mesh = MeshContext.build(ParallelismSizes())
    torch.manual_seed(rank)  # each rank starts from its own values
    model = _model(width_by_rank[rank])
    with torch.no_grad():
        model.get_buffer("scale").fill_(float(rank + 1))
    storages = {name: t.untyped_storage().data_ptr() for name, t in model.state_dict().items()}
    ddp = apply_ddp(model, dp_mesh=mesh.get_mesh("dp"))
    state = {name: t.detach().clone() for name, t in ddp.module.state_dict().items()}
    assert {n: t.untyped_storage().data_ptr() for n, t in ddp.module.state_dict().items()} == storages
    return state


def test_every_rank_gets_rank_0s_parameters_and_buffers_in_place() -> None:
    states = run_on_ranks(_sync_on_rank, world_size=2, args=([4, 4],), timeout_s=120)
    torch.manual_seed(0)
    expected = _model(4).state_dict()
    expected["scale"] = torch.ones(4)
    for state in states:
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


def test_ranks_with_different_shapes_are_refused() -> None:
    with pytest.raises(Exception, match="DDP ranks hold different parameter and buffer shapes"):
        run_on_ranks(_sync_on_rank, world_size=2, args=([4, 6],), timeout_s=120)
