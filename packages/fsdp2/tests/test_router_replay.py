"""Router replay under activation checkpointing (`apply_activation_checkpointing(...,
save_router_decisions=True)`): the recomputation routes like the forward, gradients unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from automodel.fsdp2 import apply_activation_checkpointing


class _Blocks(nn.Module):
    """A one-layer "model": the ModuleList of decoder layers the checkpointing looks for."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([layer])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


class _DriftingRouter(nn.Module):
    """A router whose input drifts on every call, as bf16 or non-deterministic kernels can make it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16))
        self.picked: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        drift = 3.0 * len(self.picked)
        probs = F.softmax(F.linear(x + drift, self.weight), dim=-1)
        values, indices = torch.topk(probs, 2, dim=-1)
        self.picked.append(indices)
        return (values.unsqueeze(-1) * x[:, None, :] * (indices.unsqueeze(-1) + 1)).sum(1)


@pytest.mark.parametrize("save", [True, False])
def test_recomputation_routes_like_the_forward_only_with_replay(save: bool) -> None:
    torch.manual_seed(0)
    module = _DriftingRouter()
    model = _Blocks(module)
    assert apply_activation_checkpointing(model, save_router_decisions=save) == 1
    model(torch.randn(32, 16)).square().sum().backward()
    assert len(module.picked) == 2  # forward + recomputation in backward
    assert torch.equal(module.picked[0], module.picked[1]) == save


def _stable_router_grad(save: bool | None) -> torch.Tensor:
    torch.manual_seed(0)
    router = nn.Linear(16, 8, bias=False)
    module = nn.Sequential(router)
    captured = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        values, indices = torch.topk(F.softmax(router(x), dim=-1), 2, dim=-1)
        captured.append(indices)
        return (values.unsqueeze(-1) * x[:, None, :] * (indices.unsqueeze(-1) + 1)).sum(1)

    setattr(module, "forward", forward)  # noqa: B010 - an instance attribute, as the HF experts have
    model = _Blocks(module)
    if save is not None:
        apply_activation_checkpointing(model, save_router_decisions=save)
    model(torch.randn(32, 16)).square().sum().backward()
    assert all(torch.equal(c, captured[0]) for c in captured)
    assert router.weight.grad is not None
    return router.weight.grad


@pytest.mark.parametrize("save", [True, False])
def test_checkpointed_router_gradients_exact(save: bool) -> None:
    torch.testing.assert_close(_stable_router_grad(save), _stable_router_grad(None), rtol=0, atol=0)
