"""Loss (and, with SGD, weight) parity of every layout with the single-process run."""

from __future__ import annotations

import pytest
import torch
from fsdp2_testlib import reference, train_on_rank

from automodel.mesh.testing import run_on_ranks

TIMEOUT = 600

LAYOUTS = {
    "fsdp_dp2": (2, {}),
    "fsdp_dp4": (4, {}),
    "hsdp_2x2": (4, {"dp_replicate": 2}),
    "tp2": (2, {"tp": 2}),
    "tp2_sp": (2, {"tp": 2, "config": {"sequence_parallel": True}}),
    "fsdp2x_tp2": (4, {"tp": 2}),
    "fsdp2x_tp2_sp_qwen3": (4, {"tp": 2, "family": "qwen3", "config": {"sequence_parallel": True}}),
    "ddp_dp2": (2, {"strategy": "ddp"}),
    "grad_accum_deferred": (2, {"accum": 2}),
    "ddp_grad_accum_deferred": (2, {"strategy": "ddp", "accum": 2}),
    "activation_checkpointing": (2, {"config": {"activation_checkpointing": True}}),
    "ddp_activation_checkpointing": (2, {"strategy": "ddp", "config": {"activation_checkpointing": True}}),
    "ac_tp2_sp": (4, {"tp": 2, "config": {"activation_checkpointing": True, "sequence_parallel": True}}),
    "cpu_offload": (2, {"offload": True}),
    "meta_init_fsdp_tp": (4, {"tp": 2, "meta": True}),
    "prefetch": (
        2,
        {"layers": 4, "config": {"enable_fsdp2_prefetch": True, "fsdp2_forward_prefetch_depth": 2}},
    ),
}


def _ref_kwargs(spec: dict) -> dict:
    return {
        "opt": spec.get("opt", "adamw"),
        "layers": spec.get("layers", 2),
        "family": spec.get("family", "llama"),
        "meta": spec.get("meta", False),
    }


def _assert_losses(got: list[float], ref: list[float], rel: float = 1e-5) -> None:
    assert len(got) == len(ref) == 5
    for step, (g, r) in enumerate(zip(got, ref)):
        assert abs(g - r) <= rel * abs(r), f"step {step}: loss {g!r} vs single-process {r!r}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_parity_adamw(name: str) -> None:
    world, spec = LAYOUTS[name]
    results = run_on_ranks(train_on_rank, world_size=world, args=(spec,), timeout_s=TIMEOUT)
    ref = reference(**_ref_kwargs(spec))
    for r in results:
        _assert_losses(r["losses"], ref["losses"])
    # The loss must actually move, or parity would prove nothing.
    assert abs(ref["losses"][-1] - ref["losses"][0]) > 1e-2


@pytest.mark.slow
def test_loss_parity_fsdp4_x_tp2_on_8_ranks() -> None:
    spec = {"tp": 2}
    results = run_on_ranks(train_on_rank, world_size=8, args=(spec,), timeout_s=TIMEOUT)
    ref = reference(**_ref_kwargs(spec))
    for r in results:
        _assert_losses(r["losses"], ref["losses"])


SGD_LAYOUTS = {
    "fsdp_dp2": (2, {}),
    "hsdp_2x2": (4, {"dp_replicate": 2}),
    "tp2_sp": (2, {"tp": 2, "config": {"sequence_parallel": True}}),
    "ddp_dp2_accum": (2, {"strategy": "ddp", "accum": 2}),
    "meta_fsdp2x_tp2": (4, {"tp": 2, "meta": True}),
}


@pytest.mark.parametrize("name", list(SGD_LAYOUTS))
def test_sgd_final_weights_match(name: str) -> None:
    world, spec = SGD_LAYOUTS[name]
    spec = {**spec, "opt": "sgd", "return_state": True}
    results = run_on_ranks(train_on_rank, world_size=world, args=(spec,), timeout_s=TIMEOUT)
    ref = reference(**_ref_kwargs(spec))
    _assert_losses(results[0]["losses"], ref["losses"])
    got = results[0]["state"]
    assert set(got) == set(ref["state"])
    for key, want in ref["state"].items():
        torch.testing.assert_close(got[key], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_bf16_mixed_precision_tracks_fp32() -> None:
    spec = {"config": {"mp_policy": {"param_dtype": "bfloat16", "reduce_dtype": "float32"}}}
    results = run_on_ranks(train_on_rank, world_size=2, args=(spec,), timeout_s=TIMEOUT)
    ref = reference(**_ref_kwargs(spec))
    got = results[0]["losses"]
    _assert_losses(got, ref["losses"], rel=3e-2)
    assert got != ref["losses"], "bf16 compute should not be bit-identical to fp32"


def test_fsdp_dp4_local_parameter_bytes() -> None:
    results = run_on_ranks(train_on_rank, world_size=4, args=({},), timeout_s=TIMEOUT)
    for r in results:
        assert r["local_fraction"] <= 0.26, r["local_fraction"]
