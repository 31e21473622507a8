"""Strategy configs: `FSDP2Config` and `DDPConfig` (field names and defaults are those of NeMo
AutoModel's configs), and `TensorParallelConfig`, the TP/SP options on their own.

Sizes (dp, tp, pp, cp, ep, dp_replicate) live in `automodel.mesh.ParallelismSizes`; these configs
carry only the flags unique to each strategy. Values read from YAML (dtype names, policy dicts)
are normalised here so the appliers only ever see torch objects.

`FSDP2Config` keeps NeMo AutoModel's TP fields (``sequence_parallel``, ``tp_plan``,
``enable_async_tensor_parallel``) for this package's users; their rules live in
`TensorParallelConfig` (one home), which a composer that owns TP apart from the strategy (the
recipes' tp parallelism) builds alone and hands to `apply_tensor_parallel_from_config`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from automodel.fsdp2.utils import import_class_from_path
from automodel.mesh import StrategyConfig, parse_dtype

_BACKENDS = ("nccl", "gloo", "cpu:gloo,cuda:nccl")


def default_mp_policy() -> MixedPrecisionPolicy:
    """bf16 parameters/compute, fp32 gradient reduction: the FSDP2Config default."""
    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
    )


def _policy_kwargs(value: dict, *, key: str) -> tuple[Any, dict]:
    value = dict(value)
    target = value.pop("_target_", None)
    cls = import_class_from_path(target) if isinstance(target, str) else target
    return cls, value


def _to_mp_policy(value: Any) -> MixedPrecisionPolicy:
    if value is None:
        return default_mp_policy()
    if isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, dict):
        cls, kwargs = _policy_kwargs(value, key="mp_policy")
        if cls not in (None, MixedPrecisionPolicy):
            raise ValueError(
                f"mp_policy._target_ must be torch.distributed.fsdp.MixedPrecisionPolicy, got {cls!r}"
            )
        for k in ("param_dtype", "reduce_dtype", "output_dtype"):
            if k in kwargs:
                kwargs[k] = parse_dtype(kwargs[k], key=f"mp_policy.{k}")
        try:
            return MixedPrecisionPolicy(**kwargs)
        except TypeError as e:
            raise ValueError(f"mp_policy: {e}") from e
    raise ValueError(f"mp_policy must be a MixedPrecisionPolicy, a dict or None, got {value!r}")


def _to_offload_policy(value: Any) -> OffloadPolicy | None:
    if value is None or isinstance(value, OffloadPolicy):
        return value
    if value is True:
        return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if isinstance(value, dict):
        cls, kwargs = _policy_kwargs(value, key="offload_policy")
        cls = cls or CPUOffloadPolicy
        if not (isinstance(cls, type) and issubclass(cls, OffloadPolicy)):
            raise ValueError(f"offload_policy._target_ must name an OffloadPolicy class, got {cls!r}")
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ValueError(f"offload_policy: {e}") from e
    raise ValueError(f"offload_policy must be a CPUOffloadPolicy, a dict, True or None, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _check_backend(value: Any) -> None:
    if value not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {value!r}")


@dataclass(frozen=True)
class TensorParallelConfig:
    """Tensor and sequence parallelism's options (NeMo AutoModel's ``distributed.sequence_parallel``,
    ``tp_plan``, ``enable_async_tensor_parallel``), validated once; async TP needs sequence
    parallelism and turns it on (with a warning), as NeMo AutoModel's manager does."""

    sequence_parallel: bool = False
    #: A custom plan: module FQN -> ParallelStyle or HF style string, or the import path of such a
    #: dict or of a function returning one (None: the model's own HF plan, else the Llama default).
    tp_plan: dict | str | None = None
    enable_async_tensor_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("sequence_parallel", "enable_async_tensor_parallel"):
            _check_bool(name, getattr(self, name))
        if self.tp_plan is not None and not isinstance(self.tp_plan, dict | str):
            raise ValueError(f"tp_plan must be a dict, an import path string or None, got {self.tp_plan!r}")
        if self.enable_async_tensor_parallel and not self.sequence_parallel:
            warnings.warn(
                "enable_async_tensor_parallel=True requires sequence_parallel; setting sequence_parallel=True",
                UserWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "sequence_parallel", True)


@dataclass(frozen=True)
class FSDP2Config(StrategyConfig):
    """Flags of the FSDP2 strategy (TP/SP plan, precision, offload, AC, compile, prefetch).

    ``mp_policy=None`` resolves to bf16 params with fp32 reduction (`default_mp_policy`); pass
    ``MixedPrecisionPolicy()`` for pure fp32 training.
    """

    LAYER_FLAGS: ClassVar[tuple[str, ...]] = (
        "activation_checkpointing",
        "enable_compile",
        "enable_fsdp2_prefetch",
    )

    sequence_parallel: bool = False
    tp_plan: dict | str | None = None
    patch_is_packed_sequence: bool = False
    mp_policy: MixedPrecisionPolicy | None = None
    offload_policy: OffloadPolicy | None = None
    autocast_dtype: torch.dtype | None = None
    activation_checkpointing: bool = False
    defer_fsdp_grad_sync: bool = True
    backend: str = "nccl"
    enable_async_tensor_parallel: bool = False
    enable_compile: bool = False
    enable_fsdp2_prefetch: bool = False
    fsdp2_backward_prefetch_depth: int = 2
    fsdp2_forward_prefetch_depth: int = 1

    def __post_init__(self) -> None:
        for name in (
            "patch_is_packed_sequence",
            "activation_checkpointing",
            "defer_fsdp_grad_sync",
            "enable_compile",
            "enable_fsdp2_prefetch",
        ):
            _check_bool(name, getattr(self, name))
        # the TP fields' rules (and async TP turning sequence parallelism on) are TensorParallelConfig's
        object.__setattr__(self, "sequence_parallel", self.tensor_parallel.sequence_parallel)
        object.__setattr__(self, "mp_policy", _to_mp_policy(self.mp_policy))
        object.__setattr__(self, "offload_policy", _to_offload_policy(self.offload_policy))
        object.__setattr__(self, "autocast_dtype", parse_dtype(self.autocast_dtype, key="autocast_dtype"))
        _check_backend(self.backend)
        for name in ("fsdp2_backward_prefetch_depth", "fsdp2_forward_prefetch_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @property
    def tensor_parallel(self) -> TensorParallelConfig:
        """Its TP fields as the TP applier takes them (`apply_tensor_parallel_from_config`)."""
        return TensorParallelConfig(
            sequence_parallel=self.sequence_parallel,
            tp_plan=self.tp_plan,
            enable_async_tensor_parallel=self.enable_async_tensor_parallel,
        )

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return None if self.mp_policy is None else self.mp_policy.param_dtype

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        return None if self.mp_policy is None else self.mp_policy.reduce_dtype

    def to_dict(self) -> dict[str, Any]:
        """Shallow dict of every field (policy objects are kept as objects)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class DDPConfig(StrategyConfig):
    """Flags of the DDP strategy (pure data parallel: no TP, PP, CP or EP)."""

    LAYER_FLAGS: ClassVar[tuple[str, ...]] = ("activation_checkpointing",)

    activation_checkpointing: bool = False
    backend: str = "nccl"

    def __post_init__(self) -> None:
        _check_bool("activation_checkpointing", self.activation_checkpointing)
        _check_backend(self.backend)

    def to_dict(self) -> dict[str, Any]:
        """Shallow dict of every field."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
