"""Decoder layers that hold the same parameter (Zamba ties one attention block into several layers)
are sharded as one FSDP2 unit: a parameter can belong to one unit only, so per-layer units fail."""

from __future__ import annotations

import torch
from torch import nn

from automodel.fsdp2.fsdp import _groups_sharing_parameters
from automodel.testing.ranks import run_on_ranks

WIDTH = 8


class _Stack(nn.Module):
    """Four layers; layers 1 and 3 share one block (the same module object, so the same parameters)."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
                nn.Sequential(shared, nn.Tanh()),
                nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
                nn.Sequential(shared, nn.Tanh()),
            ]
        )
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_layers_sharing_a_parameter_are_grouped_at_the_first_ones_place() -> None:
    model = _Stack()
    groups = _groups_sharing_parameters(list(model.layers))
    layers = list(model.layers)
    assert [[layers.index(m) for m in g] for g in groups] == [[0], [1, 3], [2]]


def test_groups_joined_by_a_later_layer_merge() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    layers = [nn.Sequential(a), nn.Sequential(b), nn.Sequential(a, b)]
    assert [[layers.index(m) for m in g] for g in _groups_sharing_parameters(layers)] == [[0, 1, 2]]


def _train_on_rank() -> tuple[int, list[float], torch.Tensor]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from automodel.fsdp2 import apply_fsdp2_sharding_recursively
    from automodel.mesh import MeshContext, ParallelismSizes

    mesh = MeshContext.build(ParallelismSizes())
    torch.manual_seed(0)
    model = _Stack()
    units = apply_fsdp2_sharding_recursively(model, mesh=mesh)
    shared = model.get_parameter("layers.1.0.weight")
    assert model.get_parameter("layers.3.0.weight") is shared and isinstance(shared, DTensor)
    assert shared.to_local().shape == (WIDTH // dist.get_world_size(), WIDTH)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x = torch.randn(2 * dist.get_world_size(), WIDTH)
    mine = x.chunk(dist.get_world_size())[dist.get_rank()]
    losses = []
    for _ in range(3):
        loss = model(mine).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return len(units), losses, shared.full_tensor().detach()


def _train_reference() -> tuple[list[float], torch.Tensor]:
    torch.manual_seed(0)
    model = _Stack()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    x = torch.randn(4, WIDTH)
    losses = []
    for _ in range(3):
        # the mean of the two ranks' per-half losses, as the sharded run averages gradients
        loss = torch.stack([model(half).pow(2).mean() for half in x.chunk(2)]).sum() / 2
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model.get_parameter("layers.1.0.weight").detach()


def test_a_shared_block_trains_as_one_unit_like_one_process() -> None:
    results = run_on_ranks(_train_on_rank, world_size=2, timeout_s=120)
    ref_losses, ref_shared = _train_reference()
    for units, losses, shared in results:
        assert units == 4  # layers 0, (1, 3), 2, and the root
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=0)
        torch.testing.assert_close(shared, ref_shared, rtol=1e-6, atol=1e-7)
