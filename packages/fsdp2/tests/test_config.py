"""FSDP2Config / DDPConfig: seed defaults, YAML-friendly normalisation, validation."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from automodel.fsdp2 import DDPConfig, FSDP2Config
from automodel.fsdp2.utils import import_class_from_path, import_classes_from_paths

SEED_DEFAULTS = {
    "sequence_parallel": False,
    "tp_plan": None,
    "patch_is_packed_sequence": False,
    "offload_policy": None,
    "autocast_dtype": None,
    "activation_checkpointing": False,
    "defer_fsdp_grad_sync": True,
    "backend": "nccl",
    "enable_async_tensor_parallel": False,
    "enable_compile": False,
    "enable_fsdp2_prefetch": False,
    "fsdp2_backward_prefetch_depth": 2,
    "fsdp2_forward_prefetch_depth": 1,
}


def test_fsdp2_defaults_and_to_dict() -> None:
    d = FSDP2Config().to_dict()
    assert set(d) == set(SEED_DEFAULTS) | {"mp_policy"}
    assert {k: d[k] for k in SEED_DEFAULTS} == SEED_DEFAULTS
    mp = d["mp_policy"]
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_ddp_defaults_and_to_dict() -> None:
    assert DDPConfig().to_dict() == {"activation_checkpointing": False, "backend": "nccl"}
    with pytest.raises(ValueError, match="backend"):
        DDPConfig(backend="mpi")


def test_yaml_style_values_are_normalised() -> None:
    cfg = FSDP2Config(
        mp_policy={
            "_target_": "torch.distributed.fsdp.MixedPrecisionPolicy",
            "param_dtype": "bfloat16",
            "reduce_dtype": "float32",
            "output_dtype": "float32",
        },
        offload_policy={"pin_memory": False},
        autocast_dtype="torch.bfloat16",
    )
    assert cfg.mp_policy == MixedPrecisionPolicy(torch.bfloat16, torch.float32, torch.float32)
    assert isinstance(cfg.offload_policy, CPUOffloadPolicy) and cfg.offload_policy.pin_memory is False
    assert cfg.autocast_dtype is torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"fsdp2_backward_prefetch_depth": 0}, "fsdp2_backward_prefetch_depth"),
        ({"fsdp2_forward_prefetch_depth": 1.5}, "fsdp2_forward_prefetch_depth"),
        ({"autocast_dtype": "float99"}, "autocast_dtype"),
        ({"mp_policy": {"param_dtype": "nope"}}, "mp_policy.param_dtype"),
        ({"mp_policy": {"bogus": 1}}, "mp_policy"),
        ({"backend": "mpi"}, "backend"),
        ({"sequence_parallel": "yes"}, "sequence_parallel"),
        ({"tp_plan": 3}, "tp_plan"),
    ],
)
def test_bad_values_name_the_key(kwargs: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        FSDP2Config(**kwargs)


def test_async_tp_forces_sequence_parallel_with_warning() -> None:
    with pytest.warns(UserWarning, match="sequence_parallel"):
        cfg = FSDP2Config(enable_async_tensor_parallel=True)
    assert cfg.sequence_parallel is True


def test_tp_options_alone_follow_the_same_rules() -> None:
    """`TensorParallelConfig` is the one home of the TP fields' rules: FSDP2Config's TP fields
    resolve to it, and it refuses and resolves them alone the same way."""
    from automodel.fsdp2 import TensorParallelConfig

    plan = {"model.layers.*.self_attn.q_proj": "colwise"}
    assert FSDP2Config(tp_plan=plan).tensor_parallel == TensorParallelConfig(tp_plan=plan)
    assert FSDP2Config().tensor_parallel == TensorParallelConfig()
    with pytest.warns(UserWarning, match="sequence_parallel"):
        alone = TensorParallelConfig(enable_async_tensor_parallel=True)
    assert alone.sequence_parallel is True
    with pytest.warns(UserWarning):
        assert FSDP2Config(enable_async_tensor_parallel=True).tensor_parallel == alone
    for kwargs, key in (({"sequence_parallel": "yes"}, "sequence_parallel"), ({"tp_plan": 3}, "tp_plan")):
        with pytest.raises(ValueError, match=key):
            TensorParallelConfig(**kwargs)


def test_import_helpers() -> None:
    assert import_class_from_path("torch.optim.AdamW") is torch.optim.AdamW
    assert import_classes_from_paths(["torch.nn.Linear", "torch.optim.SGD"]) == [
        torch.nn.Linear,
        torch.optim.SGD,
    ]
    with pytest.raises(ValueError, match="NoSuchThing"):
        import_class_from_path("torch.optim.NoSuchThing")
    with pytest.raises(ValueError, match="dotted"):
        import_class_from_path("AdamW")
