"""A parameter one rank's data routes around still joins FSDP2's gradient reduction.

LongCat-Flash routes tokens to zero-computation experts as well as real ones; when no token of a
rank reached a real expert, that rank had no gradient for the experts, reduce-scattered fewer
bytes than its peer and gloo aborted the run (SIGABRT; NCCL would hang). The gradients must be
those of one process over both ranks' data.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from automodel.testing.ranks import run_on_ranks

WIDTH = 8


class _Routed(nn.Module):
    """Rows with a positive first feature go through `expert`; the others skip it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, WIDTH)
        self.expert = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gate(x)
        routed = x[:, 0] > 0
        if routed.any():
            x = x.index_add(0, routed.nonzero()[:, 0], self.expert(x[routed]))
        return x


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Routed() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _model() -> _Model:
    torch.manual_seed(0)
    model = _Model()
    with torch.no_grad():
        for layer in model.layers:  # the gate keeps the first feature's sign: rank 1 never routes
            assert isinstance(layer, _Routed)
            layer.gate.weight.copy_(torch.eye(WIDTH))
            layer.gate.bias.zero_()
    return model


def _data() -> torch.Tensor:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1))
    x[:2, 0], x[2:, 0] = x[:2, 0].abs() + 0.1, -x[2:, 0].abs() - 0.1  # rank 0's rows route, rank 1's do not
    return x


def _sharded(_: int) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    from automodel.fsdp2 import apply_fsdp2_sharding_recursively
    from automodel.mesh import MeshContext, ParallelismSizes

    mesh = MeshContext.build(ParallelismSizes())
    model = _model()
    apply_fsdp2_sharding_recursively(model, mesh=mesh, gradient_divide_factor=1.0)
    rank = dist.get_rank()
    model(_data()[2 * rank : 2 * rank + 2]).sum().backward()
    grads = {n: cast(DTensor, p.grad).full_tensor() for n, p in model.named_parameters()}
    dist.barrier()
    return grads


def test_a_parameter_one_rank_did_not_use_is_reduced_as_zero() -> None:
    model = _model()
    model(_data()).sum().backward()
    ranks = run_on_ranks(_sharded, world_size=2, args=(0,), timeout_s=120)
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(ranks[0][name], param.grad, msg=name)
