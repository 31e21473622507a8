"""Single-process and small multi-rank checks: grouped GEMM, state dict, validation.

(Router replay under activation checkpointing is automodel.fsdp2's: its tests.)"""

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
    grouped_expert_mlp,
    grouped_mm_supported,
    parallelize_experts,
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


# ---- state dict ---------------------------------------------------------------------------
def _state_dict_rank(family: str) -> dict:
    ctx = MeshContext.build(ParallelismSizes(ep_size=2))
    model = build_tiny_model(family)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    units = parallelize_experts(model, mesh=ctx, gradient_divide_factor=1.0)
    got = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
    return {
        "keys_equal": list(got) == list(expected),
        "shapes_equal": all(got[k].shape == expected[k].shape for k in expected),
        "values_equal": all(torch.equal(got[k], expected[k]) for k in expected),
        "expert_local": tuple(
            cast(DTensor, model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")).to_local().shape
        ),
        # what FSDP2 (automodel.fsdp2) is told: each experts module a unit over ep_shard, the
        # dense divisor (1.0 here), Shard(0) while the local rows outnumber the ep_shard ranks
        "units": [(u.name, u.mesh.mesh_dim_names, u.gradient_divide_factor) for u in units],
        "placement": str(
            units[0].shard_placement_fn(model.get_parameter("model.layers.0.mlp.experts.gate_up_proj"))
        ),
    }


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_gathered_state_dict_equals_hf(family: str) -> None:
    results = run_on_ranks(_state_dict_rank, world_size=4, args=(family,), timeout_s=300)
    for r in results:
        assert r["keys_equal"] and r["shapes_equal"] and r["values_equal"], r
        assert r["expert_local"] == (4, 64, 64)  # 8 experts / ep 2 = 4 local (FSDP not applied here)
        assert r["units"] == [(f"model.layers.{i}.mlp.experts", ("ep_shard",), 1.0) for i in range(2)]
        assert r["placement"] == "S(0)"


def _ep_alone_parity_rank(family: str) -> dict:
    """EP alone on 2 ranks (ep_shard 1): the experts' gradients are whole after the all-to-all
    backward; the dense ones are summed by hand here (FSDP2's job in the recipes)."""
    ctx = MeshContext.build(ParallelismSizes(ep_size=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_tiny_model(family)
    reference = build_tiny_model(family)
    parallelize_experts(model, mesh=ctx, gradient_divide_factor=1.0)
    ids = torch.randint(0, 256, (2 * world, 16), generator=torch.Generator().manual_seed(3))

    def loss_of(m: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        logits = m(input_ids=rows).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, 256), rows[:, 1:].reshape(-1), reduction="sum")

    loss = loss_of(model, ids.chunk(world)[rank])
    loss.backward()
    for p in model.parameters():
        if not isinstance(p, DTensor) and p.grad is not None:
            dist.all_reduce(p.grad)
    total = loss.detach().clone()
    dist.all_reduce(total)
    ref_loss = torch.stack([loss_of(reference, part) for part in ids.chunk(world)]).sum()
    ref_loss.backward()
    worst = 0.0
    for name, p in reference.named_parameters():
        got, want = model.get_parameter(name).grad, p.grad
        assert got is not None and want is not None, name
        got = got.full_tensor() if isinstance(got, DTensor) else got
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
    experts = {}  # what this rank holds of each layer's stacked experts (the layout, not the config)
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert isinstance(p, DTensor), f"{name} is not distributed"
            dims = p.device_mesh.mesh_dim_names or ()
            experts[name] = {
                "placements": [(dim, str(pl)) for dim, pl in zip(dims, p.placements, strict=True)],
                "rows": p.shape[0],
                "local_rows": p.to_local()[:, 0, 0].tolist(),
                "reference_rows": reference.get_parameter(name)[:, 0, 0].tolist(),
            }
    return {
        "loss_rel": abs(total.item() - ref_loss.item()) / ref_loss.item(),
        "grad_rel": worst,
        "ep_coordinate": ctx.coordinates["ep"],
        "experts": experts,
    }


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_expert_parallel_alone_matches_one_process(family: str) -> None:
    results = run_on_ranks(_ep_alone_parity_rank, world_size=2, args=(family,), timeout_s=300)
    assert sorted(r["ep_coordinate"] for r in results) == [0, 1]
    for r in results:
        assert r["loss_rel"] < 1e-5 and r["grad_rel"] < 1e-5, r
        # the layout: every MoE layer's experts split over ep, E/ep of them on this rank, the ones
        # of its ep coordinate (with EP switched off every rank holds all E and this fails)
        assert r["experts"], "no stacked expert weights found"
        e = r["ep_coordinate"]
        for name, held in r["experts"].items():
            local = len(held["local_rows"])
            assert held["placements"] == [("ep", "S(0)")], (name, held["placements"])
            assert local * 2 == held["rows"], (name, local, held["rows"])
            assert held["local_rows"] == held["reference_rows"][e * local : (e + 1) * local], name


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


def test_parallelize_experts_rejects_bad_models() -> None:
    with fake_world(4):
        ctx = MeshContext.build(ParallelismSizes(ep_size=4))
        with pytest.raises(ValueError, match=r"ep_size=4 must divide the number of experts.*6 experts"):
            parallelize_experts(build_tiny_model("mixtral", num_experts=6), mesh=ctx)
        with pytest.raises(ValueError, match="dense model"):
            parallelize_experts(build_tiny_model("llama"), mesh=ctx)
        with pytest.raises(ValueError, match="gradient_divide_factor"):
            parallelize_experts(build_tiny_model("mixtral"), mesh=ctx, gradient_divide_factor=0.0)
        # a pipeline stage of dense layers only: nothing to split, nothing to shard apart
        assert parallelize_experts(build_tiny_model("llama"), mesh=ctx, pipeline_stage=True) == []
    with fake_world(2):
        ctx = MeshContext.build(ParallelismSizes())
        dense = build_tiny_model("llama")
        before = {n: (type(p), p.shape) for n, p in dense.named_parameters()}
        with pytest.raises(ValueError, match="ep_size > 1"):
            parallelize_experts(dense, mesh=ctx)
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
