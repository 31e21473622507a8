"""Prefetch chains as recorded, meta-device materialization, unshard, autocast."""

from __future__ import annotations

import pytest
import torch
from fsdp2_testlib import batch, fp32_policy, full_state, loss_sum, reference, tiny_model, train_on_rank

from automodel.testing.ranks import run_on_ranks


def _record_prefetch(fd: int, bd: int) -> dict:
    from automodel.fsdp2 import FSDP2Config, FSDP2Manager
    from automodel.mesh import MeshContext, ParallelismSizes

    mesh = MeshContext.build(ParallelismSizes())
    model = tiny_model(layers=4)
    config = FSDP2Config(
        backend="gloo",
        mp_policy=fp32_policy(),
        enable_fsdp2_prefetch=True,
        fsdp2_forward_prefetch_depth=fd,
        fsdp2_backward_prefetch_depth=bd,
    )
    FSDP2Manager(config, mesh).parallelize(model)
    ids = batch(0)[:2]
    loss_sum(model, ids).backward()  # lazy init happens on the first step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss_sum(model, ids).backward()
    events = sorted(
        (e for e in prof.events() if e.name.startswith("FSDP::")), key=lambda e: e.time_range.start
    )
    chains: dict[str, dict[str, list[int]]] = {"forward": {}, "backward": {}}
    gathers: list[tuple[str, str]] = []
    unit = None
    for e in events:
        name = e.name
        for phase in ("forward", "backward"):
            if name.startswith(f"FSDP::pre_{phase}"):
                unit = name.partition("(model.layers.")[2].rstrip(")") or "root"
                chains[phase].setdefault(unit, [])
            if name.startswith(f"FSDP::{phase}_prefetch for model.layers."):
                chains[phase][unit].append(int(name.rpartition(".")[2]))
        if name.startswith("FSDP::all_gather") and "copy_out" not in name:
            gathers.append(("ag", name.partition("(model.layers.")[2].rstrip(")") or "root"))
        elif name.startswith("FSDP::pre_forward"):
            gathers.append(("fwd", name.partition("(model.layers.")[2].rstrip(")") or "root"))
    return {"chains": chains, "order": gathers}


@pytest.mark.parametrize(("fd", "bd"), [(1, 1), (2, 2)])
def test_prefetch_chain_is_the_configured_one(fd: int, bd: int) -> None:
    got = run_on_ranks(_record_prefetch, world_size=2, args=(fd, bd), timeout_s=300)[0]
    n = 4
    want_fwd = {"root": list(range(min(n, fd)))}
    want_bwd = {"root": list(range(n - 1, n - 1 - bd, -1))}
    for i in range(n):
        want_fwd[str(i)] = list(range(i + 1, min(n, i + 1 + fd)))
        want_bwd[str(i)] = [j for j in range(i - 1, i - 1 - bd, -1) if j >= 0]
    assert got["chains"]["forward"] == want_fwd
    assert {k: v for k, v in got["chains"]["backward"].items() if k != "root" or v} == want_bwd
    # All-gathers really run ahead: layer i+fd is gathered before layer i+1 starts its forward.
    order = got["order"]
    for i in range(n - fd):
        assert order.index(("ag", str(i + fd))) < order.index(("fwd", str(i + 1))), order


def _meta_materialize(_: int) -> dict:
    from torch.distributed.tensor import DTensor

    from automodel.fsdp2 import FSDP2Config, FSDP2Manager, materialize_meta_model
    from automodel.mesh import MeshContext, ParallelismSizes

    mesh = MeshContext.build(ParallelismSizes(tp_size=2))
    model = tiny_model(meta=True, family="qwen3")
    FSDP2Manager(
        FSDP2Config(backend="gloo", mp_policy=fp32_policy(), activation_checkpointing=True), mesh
    ).parallelize(model)
    materialize_meta_model(model, device="cpu", seed=7)
    local = sum(p.to_local().numel() for p in model.parameters() if isinstance(p, DTensor))
    total = sum(p.numel() for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq.clone()
    return {"state": full_state(model), "local_fraction": local / total, "inv_freq": inv_freq}


def _single_materialize(_: int) -> dict:
    from automodel.fsdp2 import materialize_meta_model

    model = tiny_model(family="qwen3")
    materialize_meta_model(model, device="cpu", seed=7)
    return {"state": full_state(model), "inv_freq": model.model.rotary_emb.inv_freq.clone()}


def test_meta_materialize_is_identical_to_single_process() -> None:
    sharded = run_on_ranks(_meta_materialize, world_size=4, args=(0,), timeout_s=300)
    single = run_on_ranks(_single_materialize, world_size=1, args=(0,), timeout_s=300)[0]
    assert sharded[0]["state"].keys() == single["state"].keys()
    for key, want in single["state"].items():
        assert torch.equal(sharded[0]["state"][key], want), key
    assert torch.equal(sharded[0]["inv_freq"], single["inv_freq"])
    assert all(r["local_fraction"] <= 0.26 for r in sharded)


def _unshard(_: int) -> dict:
    from torch.distributed.tensor import DTensor

    from automodel.fsdp2 import apply_fsdp2_sharding_recursively, unshard_fsdp2_model
    from automodel.mesh import MeshContext, ParallelismSizes

    mesh = MeshContext.build(ParallelismSizes())
    model = tiny_model()
    apply_fsdp2_sharding_recursively(model, mesh=mesh)
    w = lambda: model.get_parameter("model.layers.0.mlp.gate_proj.weight")  # noqa: E731
    ids = batch(0)[:2]
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with unshard_fsdp2_model(model):
            inside_is_full = not isinstance(w(), DTensor) and tuple(w().shape) == (128, 64)
            during = model(input_ids=ids).logits
    return {
        "inside_is_full": inside_is_full,
        "after_is_sharded": isinstance(w(), DTensor),
        "same": torch.equal(before, during),
    }


def test_unshard_fsdp2_model() -> None:
    for r in run_on_ranks(_unshard, world_size=2, args=(0,), timeout_s=300):
        assert r == {"inside_is_full": True, "after_is_sharded": True, "same": True}


def test_autocast_bf16_tracks_fp32() -> None:
    spec = {"config": {"autocast_dtype": "bfloat16"}}
    got = run_on_ranks(train_on_rank, world_size=2, args=(spec,), timeout_s=300)[0]["losses"]
    ref = reference(opt="adamw", layers=2, family="llama", meta=False)["losses"]
    assert got != ref
    for g, r in zip(got, ref):
        assert abs(g - r) <= 3e-2 * abs(r)
