"""Single-process and small multi-rank checks: grouped GEMM, router replay, state dict, validation."""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from automodel.mesh import MeshContext, ParallelismSizes, ResolvedLayout, fake_world
from automodel.moe import (
    MoEParallelizerConfig,
    checkpoint_module,
    grouped_expert_mlp,
    grouped_mm_supported,
    parallelize_model,
    validate_moe_layout,
)
from automodel.testing.moe import build_tiny_model, preload
from automodel.testing.ranks import run_on_ranks

preload(("mixtral", "qwen3_moe", "llama"))


# ---- grouped GEMM -------------------------------------------------------------------------
@pytest.mark.parametrize(("hidden", "inter"), [(64, 32), (20, 6)])  # aligned, and strides grouped_mm rejects
def test_grouped_expert_mlp_matches_per_expert_loop(hidden: int, inter: int) -> None:
    torch.manual_seed(0)
    counts = [5, 0, 9, 2]
    x = torch.randn(sum(counts), hidden, requires_grad=True)
    gate_up = torch.randn(4, 2 * inter, hidden, requires_grad=True)
    down = torch.randn(4, hidden, inter, requires_grad=True)
    out = grouped_expert_mlp(x, counts=counts, gate_up_proj=gate_up, down_proj=down, act_fn=F.silu)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [t.grad.clone() for t in (x, gate_up, down)]
    for t in (x, gate_up, down):
        t.grad = None
    rows = []
    for e, part in enumerate(x.split(counts)):
        gate, up = F.linear(part, gate_up[e]).chunk(2, dim=-1)
        rows.append(F.linear(F.silu(gate) * up, down[e]))
    ref = torch.cat(rows)
    (ref * torch.linspace(-1, 1, ref.numel()).view_as(ref)).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, t in zip(grads, (x, gate_up, down), strict=True):
        torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-5)
    if hidden % 4:  # fp32 rows not a multiple of 16 bytes: the fallback loop must have been used
        assert not grouped_mm_supported(x, gate_up, down)


# ---- router replay under activation checkpointing ----------------------------------------
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
    checkpoint_module(module, save_router_decisions=save)
    module(torch.randn(32, 16)).square().sum().backward()
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
    if save is not None:
        checkpoint_module(module, save_router_decisions=save)
    module(torch.randn(32, 16)).square().sum().backward()
    assert all(torch.equal(c, captured[0]) for c in captured)
    assert router.weight.grad is not None
    return router.weight.grad


@pytest.mark.parametrize("save", [True, False])
def test_checkpointed_router_gradients_exact(save: bool) -> None:
    torch.testing.assert_close(_stable_router_grad(save), _stable_router_grad(None), rtol=0, atol=0)


# ---- state dict ---------------------------------------------------------------------------
def _state_dict_rank(family: str) -> dict:
    ctx = MeshContext.build(ParallelismSizes(ep_size=2))
    model = build_tiny_model(family)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    parallelize_model(model, mesh=ctx, config=MoEParallelizerConfig(), gradient_divide_factor=1.0)
    got = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    return {
        "keys_equal": list(got) == list(expected),
        "shapes_equal": all(got[k].shape == expected[k].shape for k in expected),
        "values_equal": all(torch.equal(got[k], expected[k]) for k in expected),
        "expert_local": tuple(
            cast(DTensor, model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")).to_local().shape
        ),
    }


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_gathered_state_dict_equals_hf(family: str) -> None:
    results = run_on_ranks(_state_dict_rank, world_size=4, args=(family,), timeout_s=300)
    for r in results:
        assert r["keys_equal"] and r["shapes_equal"] and r["values_equal"], r
        assert r["expert_local"] == (2, 64, 64)  # 8 experts / ep 2 = 4 local, FSDP Shard(0) over ep_shard 2


# ---- config and layout validation ----------------------------------------------------------
def test_config_defaults_and_validation() -> None:
    cfg = MoEParallelizerConfig()
    assert (cfg.ignore_router_for_ac, cfg.reshard_after_forward, cfg.lm_head_precision) == (True, False, None)
    assert (cfg.wrap_outer_model, cfg.mp_policy) == (True, None)
    assert MoEParallelizerConfig(lm_head_precision="float32").lm_head_precision is torch.float32
    with pytest.raises(ValueError, match="lm_head_precision"):
        MoEParallelizerConfig(lm_head_precision="float8")
    with pytest.raises(ValueError, match="reshard_after_forward"):
        MoEParallelizerConfig(reshard_after_forward="yes")
    with pytest.raises(ValueError, match="mp_policy"):
        MoEParallelizerConfig(mp_policy="bf16")


def _layout(*, world: int, dp_shard: int, cp: int = 1, ep: int) -> ResolvedLayout:
    return ResolvedLayout(world_size=world, pp=1, dp_replicate=1, dp_shard=dp_shard, cp=cp, tp=1, ep=ep)


def test_validate_layout_errors() -> None:
    with pytest.raises(ValueError, match=r"ep_size=4 must divide the number of experts.*6 experts"):
        validate_moe_layout(layout=_layout(world=4, dp_shard=4, ep=4), num_experts=[6, 6])
    with pytest.raises(ValueError, match=r"ep_size=4 must divide dp_size\*cp_size = 6"):
        validate_moe_layout(layout=_layout(world=6, dp_shard=3, cp=2, ep=4), num_experts=[8])
    with pytest.raises(ValueError, match="ep_size=2 but the model has no MoE block"):
        validate_moe_layout(layout=_layout(world=2, dp_shard=2, ep=2), num_experts=[])
    with pytest.raises(ValueError, match="ep_size=4"):
        ParallelismSizes(ep_size=4).resolve(6)  # the mesh refuses it before any model is seen
    validate_moe_layout(layout=_layout(world=4, dp_shard=4, ep=4), num_experts=[8])


def test_parallelize_model_rejects_bad_models() -> None:
    with fake_world(4):
        ctx = MeshContext.build(ParallelismSizes(ep_size=4))
        with pytest.raises(ValueError, match=r"ep_size=4 must divide the number of experts.*6 experts"):
            parallelize_model(build_tiny_model("mixtral", num_experts=6), mesh=ctx)
        with pytest.raises(ValueError, match="dense model"):
            parallelize_model(build_tiny_model("llama"), mesh=ctx)
        with pytest.raises(ValueError, match="gradient_divide_factor"):
            parallelize_model(build_tiny_model("mixtral"), mesh=ctx, gradient_divide_factor=0.0)
    with fake_world(2):
        ctx = MeshContext.build(ParallelismSizes())
        dense = build_tiny_model("llama")
        before = {n: (type(p), p.shape) for n, p in dense.named_parameters()}
        assert parallelize_model(dense, mesh=ctx) is dense
        assert {n: (type(p), p.shape) for n, p in dense.named_parameters()} == before
        assert not dist.is_initialized() or dist.get_world_size() == 2


@pytest.mark.gpu
def test_grouped_mm_cuda_bf16_matches_loop() -> None:
    """On sm90+ the grouped kernel runs in bf16; elsewhere the loop must give the same result."""
    torch.manual_seed(0)
    counts = [7, 0, 25, 32]
    x = torch.randn(sum(counts), 64, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16) / 8
    down = torch.randn(4, 64, 32, device="cuda", dtype=torch.bfloat16) / 8
    kw = dict(counts=counts, gate_up_proj=gate_up, down_proj=down, act_fn=F.silu)
    fast = grouped_expert_mlp(x, **kw)
    loop = grouped_expert_mlp(x, use_grouped_mm=False, **kw)
    torch.testing.assert_close(fast, loop, rtol=2e-2, atol=2e-2)
