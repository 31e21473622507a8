"""build_fully_shard_call: what megatron-fsdp's fully_shard_model receives for every config field."""

from __future__ import annotations

import inspect
import warnings
from dataclasses import fields

import pytest
import torch
from torch import nn

from automodel.megatron_fsdp import FIELD_DESTINATIONS, MegatronFSDPConfig, build_fully_shard_call

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron_fsdp


class Block(nn.Module):
    pass


def call_for(config: MegatronFSDPConfig, **kw):
    args = {"dp_shard_dim": "dp", "tp_dim": "tp", "unit_modules": [Block], "dp_group_size": 4}
    return build_fully_shard_call(config, **{**args, **kw})


DEFAULT_KWARGS = {
    "dp_shard_dim": "dp",
    "tp_dim": "tp",
    "fsdp_unit_modules": [Block],
    "zero_dp_strategy": "optim_grads_params",
    "init_model_with_meta_device": False,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
    "average_in_collective": False,
    "disable_bucketing": False,
    "calculate_per_token_loss": False,
    "keep_fp8_transpose_cache": False,
    "nccl_ub": False,
    "fsdp_double_buffer": False,
    "sync_model_each_microbatch": True,
    "preproc_state_dict_for_dcp_ckpt": True,
}
DEFAULT_MP = {"main_params_dtype": None, "main_grads_dtype": None, "grad_comm_dtype": None}

#: field -> (non-default value, changed fully_shard kwargs, changed MixedPrecisionPolicy fields, changed DDP config)
FLIPS = {
    "zero_dp_strategy": (1, {"zero_dp_strategy": "optim"}, {}, {}),
    "init_fsdp_with_meta_device": (True, {"init_model_with_meta_device": True}, {}, {}),
    "grad_reduce_in_fp32": (True, {}, {"main_grads_dtype": torch.float32}, {}),
    "preserve_fp32_weights": (True, {}, {"main_params_dtype": torch.float32}, {}),
    "overlap_grad_reduce": (False, {"overlap_grad_reduce": False}, {}, {}),
    "overlap_param_gather": (False, {"overlap_param_gather": False}, {}, {}),
    "check_for_nan_in_grad": (False, {}, {}, {"check_for_nan_in_grad": False}),
    "average_in_collective": (True, {"average_in_collective": True}, {}, {}),
    "disable_bucketing": (True, {"disable_bucketing": True}, {}, {}),
    "calculate_per_token_loss": (True, {"calculate_per_token_loss": True}, {}, {}),
    "keep_fp8_transpose_cache": (True, {"keep_fp8_transpose_cache": True}, {}, {}),
    "nccl_ub": (True, {"nccl_ub": True, "fsdp_double_buffer": True}, {}, {}),
    "fsdp_double_buffer": (True, {"fsdp_double_buffer": True}, {}, {}),
    "megatron_fsdp_unit_modules": (["Block"], {}, {}, {}),  # resolved to classes by resolve_unit_modules
}
#: fields consumed before megatron-fsdp (tested in test_units_and_optimizer / test_multirank).
CONSUMED_ELSEWHERE = {"sequence_parallel", "activation_checkpointing", "backend"}


def test_default_call_is_exactly_this() -> None:
    call = call_for(MegatronFSDPConfig())
    assert call.kwargs == DEFAULT_KWARGS
    assert call.mixed_precision == DEFAULT_MP
    assert call.ddp_config_overrides == {"check_for_nan_in_grad": True}


def test_every_field_has_a_destination_and_a_test() -> None:
    names = {f.name for f in fields(MegatronFSDPConfig) if f.init} | {"tp_plan"}
    assert set(FIELD_DESTINATIONS) == names
    assert set(FLIPS) | CONSUMED_ELSEWHERE | {"tp_plan"} == names


@pytest.mark.parametrize("name", sorted(FLIPS))
def test_each_field_changes_exactly_its_destination(name: str) -> None:
    value, kwargs_delta, mp_delta, ddp_delta = FLIPS[name]
    call = call_for(MegatronFSDPConfig(**{name: value}))
    assert call.kwargs == {**DEFAULT_KWARGS, **kwargs_delta}
    assert call.mixed_precision == {**DEFAULT_MP, **mp_delta}
    assert call.ddp_config_overrides == {"check_for_nan_in_grad": True, **ddp_delta}


@pytest.mark.parametrize(
    "level,name", [(0, "no_shard"), (1, "optim"), (2, "optim_grads"), (3, "optim_grads_params")]
)
def test_zero_dp_strategy_to_data_parallel_sharding_strategy(level: int, name: str) -> None:
    assert call_for(MegatronFSDPConfig(zero_dp_strategy=level)).kwargs["zero_dp_strategy"] == name


def test_megatron_fsdp_accepts_the_call() -> None:
    """The kwargs bind to the installed fully_shard_model, and the policy/DDP names exist there."""
    config = MegatronFSDPConfig(grad_reduce_in_fp32=True, preserve_fp32_weights=True, zero_dp_strategy=2)
    call = call_for(config, dp_shard_dim="dp_cp")
    kwargs = call.fully_shard_model_kwargs()
    signature = inspect.signature(megatron_fsdp.fully_shard_model)
    signature.bind(module=nn.Linear(2, 2), device_mesh=None, device=None, **kwargs)
    policy = kwargs["mixed_precision_policy"]
    assert isinstance(policy, megatron_fsdp.MixedPrecisionPolicy)
    assert (policy.main_params_dtype, policy.main_grads_dtype, policy.grad_comm_dtype) == (
        torch.float32,
        torch.float32,
        None,
    )
    ddp_config = megatron_fsdp.DistributedDataParallelConfig()
    for key in call.ddp_config_overrides:
        assert hasattr(ddp_config, key)
    assert kwargs["dp_shard_dim"] == "dp_cp"


def test_nccl_ub_forces_double_buffer_with_a_note() -> None:
    call = call_for(MegatronFSDPConfig(nccl_ub=True, check_for_nan_in_grad=False))
    assert call.kwargs["fsdp_double_buffer"] is True
    assert len(call.warnings) == 1 and "fsdp_double_buffer" in call.warnings[0]


def test_nan_check_with_overlap_is_warned_not_dropped() -> None:
    assert any("check_for_nan_in_grad" in w for w in call_for(MegatronFSDPConfig()).warnings)
    quiet = call_for(MegatronFSDPConfig(overlap_grad_reduce=False))
    assert quiet.warnings == () and quiet.ddp_config_overrides["check_for_nan_in_grad"] is True


@pytest.mark.parametrize(
    "config,factor,per_token",
    [
        (MegatronFSDPConfig(), None, False),
        (MegatronFSDPConfig(calculate_per_token_loss=True), None, True),
        (MegatronFSDPConfig(), 1.0, True),
        (MegatronFSDPConfig(calculate_per_token_loss=True), 1.0, True),
        (MegatronFSDPConfig(), 4, False),
        (MegatronFSDPConfig(average_in_collective=True), 4.0, False),
    ],
)
def test_gradient_divide_factor(config: MegatronFSDPConfig, factor: float | None, per_token: bool) -> None:
    assert call_for(config, gradient_divide_factor=factor).kwargs["calculate_per_token_loss"] is per_token


@pytest.mark.parametrize(
    "config,factor,words",
    [
        (
            MegatronFSDPConfig(average_in_collective=True),
            1.0,
            ["gradient_divide_factor=1.0", "average_in_collective"],
        ),
        (
            MegatronFSDPConfig(calculate_per_token_loss=True),
            4,
            ["gradient_divide_factor=4", "calculate_per_token_loss"],
        ),
        (MegatronFSDPConfig(), 3.0, ["gradient_divide_factor=3.0", "4"]),
        (MegatronFSDPConfig(), -1.0, ["gradient_divide_factor", "-1.0"]),
        (MegatronFSDPConfig(), True, ["gradient_divide_factor", "True"]),
    ],
)
def test_gradient_divide_factor_errors(config: MegatronFSDPConfig, factor: object, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        call_for(config, gradient_divide_factor=factor)
    for word in words:
        assert word in str(info.value)
