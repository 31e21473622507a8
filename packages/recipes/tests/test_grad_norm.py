"""The global gradient norm: every placement a layout gives a gradient, summed in float64."""

from __future__ import annotations

import torch

from automodel.testing.ranks import run_on_ranks


def _norms_on_rank() -> list[tuple[str, float, float]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from automodel.recipes.grad_norm import total_grad_norm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_cp", "tp"))
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    exact = float(full.double().norm())
    out = []
    for placements in (
        [Shard(0), Shard(0)],
        [Shard(0), Shard(1)],
        [Shard(0), Replicate()],  # an FSDP-sharded norm weight, replicated over tp
        [Replicate(), Shard(0)],  # HSDP-style replication on the first dim
        [_StridedShard(0, split_factor=2), Shard(0)],  # FSDP2 over a colwise TP weight
    ):
        grad = distribute_tensor(full, mesh, placements)
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        plain = torch.nn.Parameter(torch.zeros(3))
        plain.grad = torch.full((3,), 2.0)  # a gradient outside any mesh joins once
        got = float(total_grad_norm([param, plain]))
        out.append((str(placements), got, (exact**2 + 12.0) ** 0.5))
    return out


def test_every_placement_is_summed_once_over_the_dims_it_is_split_on() -> None:
    for rank_result in run_on_ranks(_norms_on_rank, world_size=4):
        for placements, got, want in rank_result:
            assert abs(got - want) <= 1e-6 * want, (placements, got, want)


def test_large_tensor_norm_is_accumulated_in_float64() -> None:
    """torch's float32 norm of 1e7 values drifts by ~1e-4 relative on CPU; a float64 accumulator does not."""
    from automodel.recipes.grad_norm import total_grad_norm

    x = torch.randn(10_000_000, generator=torch.Generator().manual_seed(1))
    param = torch.nn.Parameter(torch.zeros_like(x))
    param.grad = x
    exact = float(x.double().norm())
    assert abs(float(total_grad_norm([param])) - exact) <= 1e-6 * exact
