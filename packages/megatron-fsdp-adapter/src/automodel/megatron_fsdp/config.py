"""`MegatronFSDPConfig`: the flags of `strategy: megatron_fsdp`, validated where they are written.

Sizes (dp, tp, cp) live in `automodel.mesh.ParallelismSizes`; this holds only what is specific to
Megatron-FSDP. Every field reaches megatron-fsdp (see `translate.py`) or is consumed here
(`activation_checkpointing`, `tp_plan`, `backend`); none is dropped.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field, fields
from typing import Any

import torch

from automodel.fsdp2 import TensorParallelConfig
from automodel.mesh import StrategyConfig

#: zero_dp_strategy <-> megatron-fsdp's DistributedDataParallelConfig.data_parallel_sharding_strategy.
ZERO_DP_STRATEGIES: dict[int, str] = {
    0: "no_shard",
    1: "optim",
    2: "optim_grads",
    3: "optim_grads_params",
}
_STRATEGY_BY_NAME = {name: level for level, name in ZERO_DP_STRATEGIES.items()}
_BACKENDS = ("nccl", "gloo", "cpu:gloo,cuda:nccl")

_BOOL_FIELDS = (
    "sequence_parallel",
    "init_fsdp_with_meta_device",
    "grad_reduce_in_fp32",
    "preserve_fp32_weights",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "check_for_nan_in_grad",
    "average_in_collective",
    "disable_bucketing",
    "calculate_per_token_loss",
    "keep_fp8_transpose_cache",
    "nccl_ub",
    "fsdp_double_buffer",
    "activation_checkpointing",
)


@dataclass(frozen=True)
class MegatronFSDPConfig(StrategyConfig):
    """Additional configuration for Megatron-FSDP training (seed defaults).

    `tp_plan` is an init-only argument (a custom TP plan: module FQN -> ParallelStyle or HF style
    string, or the import path of such a dict or of a function returning one, as in FSDP2Config);
    it is kept as `custom_tp_plan` and is not part of `fields()`.
    `zero_dp_strategy` also accepts the megatron-fsdp names (``"optim_grads_params"`` ...) and
    is stored as the int level 0..3.
    """

    sequence_parallel: bool = False
    tp_plan: InitVar[dict | str | None] = None
    megatron_fsdp_unit_modules: list[str] | None = None
    zero_dp_strategy: int = 3
    init_fsdp_with_meta_device: bool = False
    grad_reduce_in_fp32: bool = False
    preserve_fp32_weights: bool = False
    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    check_for_nan_in_grad: bool = True
    average_in_collective: bool = False
    disable_bucketing: bool = False
    calculate_per_token_loss: bool = False
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    activation_checkpointing: bool = False
    backend: str = "nccl"
    custom_tp_plan: dict | str | None = field(default=None, init=False, repr=False)

    def __post_init__(self, tp_plan: dict | str | None) -> None:
        for name in _BOOL_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
        object.__setattr__(self, "zero_dp_strategy", _parse_zero_dp_strategy(self.zero_dp_strategy))
        _check_sequence_parallel(self.sequence_parallel)
        if self.megatron_fsdp_unit_modules is not None:
            object.__setattr__(
                self, "megatron_fsdp_unit_modules", _parse_unit_modules(self.megatron_fsdp_unit_modules)
            )
        if self.init_fsdp_with_meta_device and self.zero_dp_strategy == 0:
            raise ValueError(
                "init_fsdp_with_meta_device=True needs sharded parameters, but zero_dp_strategy=0 "
                "(no_shard) keeps full copies; use zero_dp_strategy 1..3 or init_fsdp_with_meta_device=False"
            )
        if self.calculate_per_token_loss and self.average_in_collective:
            raise ValueError(
                "calculate_per_token_loss=True makes megatron-fsdp sum gradients, so "
                "average_in_collective=True would be ignored; set one of them to False"
            )
        if self.backend not in _BACKENDS:
            raise ValueError(
                f"backend must be one of {', '.join(map(repr, _BACKENDS))}, got {self.backend!r}"
            )
        _check_tp_plan(tp_plan)
        object.__setattr__(self, "custom_tp_plan", tp_plan)

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return torch.float32 if self.grad_reduce_in_fp32 else None

    @property
    def data_parallel_sharding_strategy(self) -> str:
        """The megatron-fsdp name of `zero_dp_strategy`."""
        return ZERO_DP_STRATEGIES[self.zero_dp_strategy]

    def to_dict(self) -> dict[str, Any]:
        """All fields plus ``tp_plan`` (shallow: plan objects are kept as they are)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "custom_tp_plan"}
        out["tp_plan"] = self.custom_tp_plan
        return out


def check_tensor_parallel(config: TensorParallelConfig) -> None:
    """The TP options megatron-fsdp's wrapper honours (it applies TP itself, before wrapping):
    ValueError for sequence parallelism (async TP included) and for a plan it cannot take, worded
    as `MegatronFSDPConfig`'s own fields are (a composer that owns TP apart from the strategy's
    flags checks its options here)."""
    _check_sequence_parallel(config.sequence_parallel)
    _check_tp_plan(config.tp_plan)


def _check_sequence_parallel(value: bool) -> None:
    if value:
        raise ValueError(
            "sequence_parallel=True is not supported with strategy megatron_fsdp "
            "(megatron-fsdp does not shard the sequence-parallel activations); use strategy fsdp2"
        )


def _check_tp_plan(tp_plan: object) -> None:
    if tp_plan is not None and not (
        (isinstance(tp_plan, dict) and all(isinstance(k, str) for k in tp_plan))
        or (isinstance(tp_plan, str) and "." in tp_plan)
    ):
        raise ValueError(
            f"tp_plan must be a dict of module FQN -> parallel style, or the import path of one "
            f"(or of a function returning one), got {tp_plan!r}"
        )


def _parse_zero_dp_strategy(value: object) -> int:
    if isinstance(value, str) and value in _STRATEGY_BY_NAME:
        return _STRATEGY_BY_NAME[value]
    if isinstance(value, int) and not isinstance(value, bool) and value in ZERO_DP_STRATEGIES:
        return value
    raise ValueError(
        f"zero_dp_strategy must be 0, 1, 2 or 3 (or one of {', '.join(map(repr, _STRATEGY_BY_NAME))}), got {value!r}"
    )


def _parse_unit_modules(value: object) -> list[str]:
    if isinstance(value, str) or not isinstance(value, list | tuple):
        raise ValueError(f"megatron_fsdp_unit_modules must be a list of class names, got {value!r}")
    if not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(
            f"megatron_fsdp_unit_modules must be a non-empty list of class names or import paths "
            f"(or None for the model's _no_split_modules), got {value!r}"
        )
    return list(value)
