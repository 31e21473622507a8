"""MegatronFSDPConfig: every seed field and default, init-only tp_plan, and the validation errors."""

from __future__ import annotations

from dataclasses import fields

import pytest

from automodel.megatron_fsdp import ZERO_DP_STRATEGIES, MegatronFSDPConfig

#: NeMo AutoModel's config (nemo_automodel.components.distributed.config.MegatronFSDPConfig), field: default.
SEED_DEFAULTS = {
    "sequence_parallel": False,
    "megatron_fsdp_unit_modules": None,
    "zero_dp_strategy": 3,
    "init_fsdp_with_meta_device": False,
    "grad_reduce_in_fp32": False,
    "preserve_fp32_weights": False,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
    "check_for_nan_in_grad": True,
    "average_in_collective": False,
    "disable_bucketing": False,
    "calculate_per_token_loss": False,
    "keep_fp8_transpose_cache": False,
    "nccl_ub": False,
    "fsdp_double_buffer": False,
    "activation_checkpointing": False,
    "backend": "nccl",
}


def test_every_seed_field_with_its_default() -> None:
    config = MegatronFSDPConfig()
    init_fields = {f.name for f in fields(config) if f.init}
    assert init_fields == set(SEED_DEFAULTS)
    assert {name: getattr(config, name) for name in SEED_DEFAULTS} == SEED_DEFAULTS
    assert config.custom_tp_plan is None


def test_tp_plan_is_init_only_and_kept() -> None:
    plan = {"model.layers.*.self_attn.q_proj": "colwise"}
    config = MegatronFSDPConfig(tp_plan=plan)
    assert "tp_plan" not in {f.name for f in fields(config)}
    assert config.custom_tp_plan is plan
    assert config.to_dict()["tp_plan"] is plan
    assert set(config.to_dict()) == set(SEED_DEFAULTS) | {"tp_plan"}


def test_tp_plan_may_be_an_import_path() -> None:
    assert MegatronFSDPConfig(tp_plan="my_pkg.plans.llama_plan").custom_tp_plan == "my_pkg.plans.llama_plan"


def test_tp_options_given_apart_follow_the_configs_rules() -> None:
    """A composer that owns the TP options apart from this config (`TensorParallelConfig`) gets
    the same refusals, worded the same, as the config's own fields."""
    from automodel.fsdp2 import TensorParallelConfig
    from automodel.megatron_fsdp import check_tensor_parallel

    plan = {"model.layers.*.self_attn.q_proj": "colwise"}
    check_tensor_parallel(TensorParallelConfig(tp_plan=plan))
    check_tensor_parallel(TensorParallelConfig(tp_plan="my_pkg.plans.llama_plan"))
    for own, apart in (
        ({"sequence_parallel": True}, TensorParallelConfig(sequence_parallel=True)),
        ({"tp_plan": "plan"}, TensorParallelConfig(tp_plan="plan")),
        ({"tp_plan": {1: "colwise"}}, TensorParallelConfig(tp_plan={1: "colwise"})),
    ):
        with pytest.raises(ValueError) as by_config:
            MegatronFSDPConfig(**own)
        with pytest.raises(ValueError) as by_check:
            check_tensor_parallel(apart)
        assert str(by_check.value) == str(by_config.value)
    with (
        pytest.warns(UserWarning, match="sequence_parallel"),
        pytest.raises(ValueError, match="sequence_parallel=True"),
    ):
        check_tensor_parallel(TensorParallelConfig(enable_async_tensor_parallel=True))


@pytest.mark.parametrize("level,name", sorted(ZERO_DP_STRATEGIES.items()))
def test_zero_dp_strategy_levels_and_names(level: int, name: str) -> None:
    by_level, by_name = MegatronFSDPConfig(zero_dp_strategy=level), MegatronFSDPConfig(zero_dp_strategy=name)
    assert by_level.zero_dp_strategy == by_name.zero_dp_strategy == level
    assert by_level.data_parallel_sharding_strategy == name


def test_unit_modules_tuple_becomes_list() -> None:
    config = MegatronFSDPConfig(megatron_fsdp_unit_modules=("LlamaDecoderLayer",))
    assert config.megatron_fsdp_unit_modules == ["LlamaDecoderLayer"]


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"zero_dp_strategy": 4}, ["zero_dp_strategy", "4"]),
        ({"zero_dp_strategy": True}, ["zero_dp_strategy", "True"]),
        ({"zero_dp_strategy": "zero3"}, ["zero_dp_strategy", "zero3"]),
        ({"sequence_parallel": True}, ["sequence_parallel", "fsdp2"]),
        ({"overlap_grad_reduce": "yes"}, ["overlap_grad_reduce", "'yes'"]),
        ({"check_for_nan_in_grad": 1}, ["check_for_nan_in_grad", "1"]),
        (
            {"megatron_fsdp_unit_modules": "LlamaDecoderLayer"},
            ["megatron_fsdp_unit_modules", "LlamaDecoderLayer"],
        ),
        ({"megatron_fsdp_unit_modules": []}, ["megatron_fsdp_unit_modules", "[]"]),
        ({"megatron_fsdp_unit_modules": ["A", 3]}, ["megatron_fsdp_unit_modules", "3"]),
        (
            {"init_fsdp_with_meta_device": True, "zero_dp_strategy": 0},
            ["init_fsdp_with_meta_device", "zero_dp_strategy=0"],
        ),
        (
            {"calculate_per_token_loss": True, "average_in_collective": True},
            ["calculate_per_token_loss", "average_in_collective"],
        ),
        ({"backend": "mpi"}, ["backend", "'mpi'"]),
        ({"tp_plan": ["colwise"]}, ["tp_plan", "colwise"]),
        ({"tp_plan": "colwise"}, ["tp_plan", "'colwise'"]),
    ],
)
def test_user_mistakes_name_the_key_and_value(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        MegatronFSDPConfig(**kwargs)
    for word in words:
        assert word in str(info.value)
