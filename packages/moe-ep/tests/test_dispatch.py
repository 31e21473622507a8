"""Dispatch/combine on real ranks: token conservation, skewed routing, parity of the experts module."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from automodel.mesh import MeshContext, ParallelismSizes
from automodel.moe import apply_ep, combine_tokens, dispatch_tokens, plan_dispatch
from automodel.testing.moe import build_tiny_model, preload
from automodel.testing.ranks import run_on_ranks

preload(("mixtral",))

HIDDEN = 64


def _routing(pattern: str, *, rank: int, num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    if pattern == "random":
        rows = [torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]
        return torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.long)
    if pattern == "all_to_expert0":  # every slot of every token on one expert (one rank gets everything)
        return torch.zeros(num_tokens, top_k, dtype=torch.long)
    if pattern == "two_hot_experts":  # experts 0 and 1 take every token; the rest (and their ranks) get none
        return torch.tensor([[0, 1]] * num_tokens, dtype=torch.long)[:, :top_k]
    raise AssertionError(pattern)


def _conservation_rank(pattern: str, num_experts: int, top_k: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    num_tokens = 5 + 3 * rank if pattern != "empty_rank" else (0 if rank == 1 else 7)
    idx = _routing(
        "random" if pattern == "empty_rank" else pattern,
        rank=rank,
        num_tokens=num_tokens,
        num_experts=num_experts,
        top_k=top_k,
    )
    # Row t of rank r carries (r, t) so a receiver can tell exactly which token it got.
    x = torch.zeros(num_tokens, HIDDEN)
    x[:, 0], x[:, 1] = float(rank), torch.arange(num_tokens, dtype=torch.float)
    x.requires_grad_(True)
    plan = plan_dispatch(idx, num_experts=num_experts, group=None)
    received = dispatch_tokens(x, plan, group=None)
    local = num_experts // world
    got = []
    for e, part in enumerate(received.split(plan.local_counts)):
        got += [(rank * local + e, int(r), int(t)) for r, t in part[:, :2].tolist()]
    all_idx = [None] * world
    dist.all_gather_object(all_idx, idx.tolist())
    expected = sorted(
        (e, r, t)
        for r, rows in enumerate(all_idx)
        for t, row in enumerate(rows)
        for e in row
        if e // local == rank
    )
    # Each expert scales what it computes by (global id + 1); combine weights slot k by (k + 1).
    scale = torch.repeat_interleave(
        torch.arange(rank * local, (rank + 1) * local, dtype=torch.float) + 1, torch.tensor(plan.local_counts)
    )
    weights = (torch.arange(top_k, dtype=torch.float) + 1).expand(num_tokens, top_k)
    out = combine_tokens(
        received * scale.unsqueeze(-1),
        plan,
        top_k_weights=weights,
        num_tokens=num_tokens,
        out_dtype=x.dtype,
        group=None,
    )
    factor = ((idx.float() + 1) * weights).sum(-1, keepdim=True)
    out.sum().backward()
    return {
        "got": sorted(got),
        "expected": expected,
        "out_err": (out - x.detach() * factor).abs().max().item() if num_tokens else 0.0,
        "grad_err": (x.grad - factor.expand_as(x)).abs().max().item() if num_tokens else 0.0,
        "received": plan.num_received,
        "sent": sum(plan.send_splits),
    }


@pytest.mark.parametrize(
    ("pattern", "world", "num_experts", "top_k"),
    [
        ("random", 4, 8, 2),
        ("all_to_expert0", 2, 4, 1),
        ("two_hot_experts", 4, 8, 2),
        ("empty_rank", 2, 4, 2),
    ],
)
def test_every_routed_token_computed_once_per_slot(
    pattern: str, world: int, num_experts: int, top_k: int
) -> None:
    results = run_on_ranks(
        _conservation_rank, world_size=world, args=(pattern, num_experts, top_k), timeout_s=300
    )
    for r in results:
        assert r["got"] == r["expected"]  # the exact multiset of (expert, source rank, token)
        assert r["out_err"] < 1e-6 and r["grad_err"] < 1e-6
    if pattern in ("all_to_expert0", "two_hot_experts"):
        assert min(r["received"] for r in results) == 0  # some rank's experts got no token at all
    if pattern == "empty_rank":
        assert results[1]["sent"] == 0 and results[1]["received"] > 0


def _experts_rank(pattern: str, top_k: int) -> float:
    """The EP experts module vs HF's eager loop on the same tokens and routing, forward and backward."""
    rank = dist.get_rank()
    ctx = MeshContext.build(ParallelismSizes(ep_size=dist.get_world_size()))
    block = build_tiny_model("mixtral", num_experts=8, top_k=top_k).get_submodule("model.layers.0.mlp")
    ref = copy.deepcopy(block.get_submodule("experts"))
    apply_ep(block, ep_mesh=ctx.get_mesh("ep"))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(12, HIDDEN, generator=g)
    idx = _routing(pattern, rank=rank, num_tokens=12, num_experts=8, top_k=top_k)
    w = torch.rand(12, top_k, generator=g)
    out = block.get_submodule("experts")(x, idx, w)
    want = ref(x, idx, w)
    out.square().sum().backward()
    want.square().sum().backward()
    worst = (out - want).abs().max().item()
    for name in ("gate_up_proj", "down_proj"):
        grad = getattr(block.experts, name).grad.full_tensor()
        # Each rank's reference saw only its own tokens: sum the reference gradients over ranks.
        ref_grad = getattr(ref, name).grad.clone()
        dist.all_reduce(ref_grad)
        worst = max(worst, ((grad - ref_grad).abs().max() / ref_grad.abs().max().clamp_min(1e-12)).item())
    return worst


@pytest.mark.parametrize(("pattern", "top_k"), [("random", 2), ("all_to_expert0", 1), ("two_hot_experts", 2)])
def test_experts_module_matches_hf_under_skew(pattern: str, top_k: int) -> None:
    assert max(run_on_ranks(_experts_rank, world_size=4, args=(pattern, top_k), timeout_s=300)) < 1e-5


def _load_rank() -> tuple[float, float, int]:
    from automodel.moe import ExpertLoad

    rank = dist.get_rank()
    # 4 experts over 2 ranks (rank r owns experts 2r, 2r+1); rank 0 sends 6 slots to expert 0 and
    # 2 to expert 3, rank 1 sends 4 to expert 1 and 4 to expert 2: rank 0 receives 10, rank 1 6
    idx = torch.tensor([[0, 0], [0, 0], [0, 3], [0, 3]]) if rank == 0 else torch.tensor([[1, 2]] * 4)
    outside = plan_dispatch(idx, num_experts=4, group=None)  # not counted: no ExpertLoad active
    with ExpertLoad() as load:
        plan = plan_dispatch(idx, num_experts=4, group=None)
    balanced = ExpertLoad()
    return load.load_factor(), balanced.load_factor(), plan.num_received + 0 * outside.num_received


def test_expert_load_factor_is_the_busiest_ranks_received_rows_over_the_mean() -> None:
    results = run_on_ranks(_load_rank, world_size=2)
    assert [r[2] for r in results] == [10, 6]
    assert all(factor == pytest.approx(10 / 8) for factor, _, _ in results)
    assert all(idle == 1.0 for _, idle, _ in results)  # nothing dispatched: reported as balanced
