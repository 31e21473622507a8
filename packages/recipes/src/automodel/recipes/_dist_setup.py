"""The YAML ``distributed:`` section -> validated settings -> `MeshContext` (seed 01's flow).

YAML distributed section
  -> parse_distributed_section()   sizes, strategy flags, pipeline / moe sub-sections, every rule
  -> setup_distributed()           process group, MeshContext, strategy / pipeline / moe configs
  -> recipes.parallelize           applies them to the model in DESIGN §2 order
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from automodel.mesh import MeshContext, ParallelismSizes, ResolvedLayout, init_distributed
from automodel.recipes.availability import has_api, require_api
from automodel.recipes.errors import ConfigError, reject_unknown
from automodel.recipes.instantiate import instantiate

STRATEGIES = ("fsdp2", "megatron_fsdp", "ddp")
SIZE_KEYS = ("dp_size", "dp_replicate_size", "tp_size", "pp_size", "cp_size", "ep_size")
COMMON_KEYS = ("strategy", *SIZE_KEYS, "pipeline", "moe")

# Strategy flags per seed 02 (used when the strategy package is not installed yet; otherwise the
# fields of its config dataclass are the source of truth).
_FSDP2_FLAGS = (
    "sequence_parallel", "tp_plan", "patch_is_packed_sequence", "mp_policy", "offload_policy",
    "autocast_dtype", "activation_checkpointing", "defer_fsdp_grad_sync", "backend",
    "enable_async_tensor_parallel", "enable_compile", "enable_fsdp2_prefetch",
    "fsdp2_backward_prefetch_depth", "fsdp2_forward_prefetch_depth",
)  # fmt: skip
_MEGATRON_FLAGS = (
    "sequence_parallel", "tp_plan", "megatron_fsdp_unit_modules", "zero_dp_strategy",
    "init_fsdp_with_meta_device", "grad_reduce_in_fp32", "preserve_fp32_weights", "overlap_grad_reduce",
    "overlap_param_gather", "check_for_nan_in_grad", "average_in_collective", "disable_bucketing",
    "calculate_per_token_loss", "keep_fp8_transpose_cache", "nccl_ub", "fsdp_double_buffer",
    "activation_checkpointing", "backend",
)  # fmt: skip
_DDP_FLAGS = ("activation_checkpointing", "backend")
_BOOL_FLAGS = ("sequence_parallel", "activation_checkpointing", "defer_fsdp_grad_sync", "enable_compile")

_STRATEGY_API = {
    "fsdp2": ("automodel.fsdp2", "FSDP2Config", _FSDP2_FLAGS),
    "megatron_fsdp": ("automodel.megatron_fsdp", "MegatronFSDPConfig", _MEGATRON_FLAGS),
    "ddp": ("automodel.fsdp2", "DDPConfig", _DDP_FLAGS),
}


def strategy_flags(strategy: str) -> tuple[str, ...]:
    """Keys the strategy accepts besides the sizes: its config dataclass's fields when installed."""
    module, cls_name, fallback = _STRATEGY_API[strategy]
    if has_api(module, cls_name):
        (cls,) = require_api(module, cls_name, key="distributed.strategy", value=strategy)
        if dataclasses.is_dataclass(cls):
            return tuple(f.name for f in dataclasses.fields(cls) if f.init)
    return fallback


@dataclass
class DistributedSection:
    """The parsed ``distributed:`` section: sizes, strategy, its flags, and the sub-sections."""

    strategy: str
    sizes: ParallelismSizes
    options: dict[str, Any] = field(default_factory=dict)
    pipeline: dict[str, Any] | None = None
    moe: dict[str, Any] | None = None

    @property
    def sequence_parallel(self) -> bool:
        return bool(self.options.get("sequence_parallel", False))

    @property
    def activation_checkpointing(self) -> bool:
        return bool(self.options.get("activation_checkpointing", False))

    @property
    def defer_fsdp_grad_sync(self) -> bool:
        return bool(self.options.get("defer_fsdp_grad_sync", True)) and self.strategy == "fsdp2"


def _size(data: dict, key: str) -> int | None:
    value = data.get(key, None if key in ("dp_size", "dp_replicate_size") else 1)
    if (
        isinstance(value, str)
        and value.lower() in ("none", "null", "auto")
        and key in ("dp_size", "dp_replicate_size")
    ):
        return None
    if value is None and key in ("dp_size", "dp_replicate_size"):
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"distributed.{key}", value, "must be an int >= 1" + (" or none" if key.startswith("dp") else "")
        )
    return value


def parse_distributed_section(data: Any) -> DistributedSection:
    """Validate the section against seed 01's schema and rules; `ConfigError` names the key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("distributed", data, "must be a mapping")
    strategy = data.get("strategy", "fsdp2")
    if strategy not in STRATEGIES:
        raise ConfigError("distributed.strategy", strategy, f"must be one of {', '.join(STRATEGIES)}")
    flags = strategy_flags(strategy)
    known = set(COMMON_KEYS) | set(flags) | set(_FSDP2_FLAGS) | set(_MEGATRON_FLAGS)
    reject_unknown("distributed", data, known)
    for key in data:
        if key not in COMMON_KEYS and key not in flags:
            raise ConfigError(f"distributed.{key}", data[key], f"is not an option of strategy {strategy!r}")
    for key in _BOOL_FLAGS:
        if key in data and not isinstance(data[key], bool):
            raise ConfigError(f"distributed.{key}", data[key], "must be true or false")
    sizes = {k: _size(data, k) for k in SIZE_KEYS}
    tp, pp, cp, ep = sizes["tp_size"], sizes["pp_size"], sizes["cp_size"], sizes["ep_size"]
    sp = data.get("sequence_parallel", False)

    if sizes["dp_replicate_size"] is not None and strategy != "fsdp2":
        raise ConfigError(
            "distributed.dp_replicate_size",
            sizes["dp_replicate_size"],
            f"is FSDP2-only (strategy={strategy})",
        )
    if strategy == "megatron_fsdp":
        for key, value in (("pp_size", pp), ("ep_size", ep)):
            if value > 1:
                raise ConfigError(
                    f"distributed.{key}", value, "megatron_fsdp does not support it (must be 1)"
                )
        if sp:
            raise ConfigError(
                "distributed.sequence_parallel", sp, "megatron_fsdp does not support sequence_parallel"
            )
    if strategy == "ddp":
        for key, value in (("tp_size", tp), ("pp_size", pp), ("cp_size", cp), ("ep_size", ep)):
            if value > 1:
                raise ConfigError(f"distributed.{key}", value, "ddp is data parallelism only (must be 1)")
    if sp and tp == 1:
        raise ConfigError(
            "distributed.sequence_parallel", sp, "needs tp_size > 1 (sequence parallelism splits TP regions)"
        )
    if "defer_fsdp_grad_sync" in data and strategy != "fsdp2":
        raise ConfigError("distributed.defer_fsdp_grad_sync", data["defer_fsdp_grad_sync"], "is FSDP2-only")

    pipeline = data.get("pipeline")
    if pipeline is not None and not isinstance(pipeline, dict):
        raise ConfigError("distributed.pipeline", pipeline, "must be a mapping")
    if pp > 1 and pipeline is None:
        raise ConfigError("distributed.pp_size", pp, "pp_size > 1 needs a distributed.pipeline section")
    if pp == 1 and pipeline is not None:
        warnings.warn("distributed.pipeline is ignored because pp_size == 1", stacklevel=2)
        pipeline = None

    moe = data.get("moe")
    if moe is not None and not isinstance(moe, dict):
        raise ConfigError("distributed.moe", moe, "must be a mapping")
    if ep == 1 and moe is not None:
        warnings.warn("distributed.moe is ignored because ep_size == 1", stacklevel=2)
        moe = None

    try:
        psizes = ParallelismSizes(**sizes)
    except ValueError as e:  # pragma: no cover - every size was checked above
        raise ConfigError("distributed", sizes, str(e)) from None
    options = {k: instantiate(v, key=f"distributed.{k}") for k, v in data.items() if k not in COMMON_KEYS}
    return DistributedSection(strategy=strategy, sizes=psizes, options=options, pipeline=pipeline, moe=moe)


def resolve_layout(section: DistributedSection, world_size: int) -> ResolvedLayout:
    """Every divisibility rule of the sizes against `world_size`, as a `ConfigError`."""
    try:
        return section.sizes.resolve(world_size)
    except ValueError as e:
        s = section.sizes
        value = (
            f"tp={s.tp_size} pp={s.pp_size} cp={s.cp_size} ep={s.ep_size} dp={s.dp_size} world={world_size}"
        )
        raise ConfigError("distributed", value, str(e)) from None


@dataclass
class DistributedSetup:
    """What `setup_distributed` returns: this rank's meshes plus the section they came from."""

    mesh: MeshContext
    section: DistributedSection
    rank: int
    world_size: int
    device: Any


def setup_distributed(
    section: DistributedSection, *, backend: str | None = None, timeout_minutes: float = 10.0
) -> DistributedSetup:
    """Initialize (or reuse) the default process group and build the `MeshContext` for `section`."""
    info = init_distributed(backend=backend, timeout_minutes=timeout_minutes)
    resolve_layout(section, info.world_size)
    mesh = MeshContext.build(section.sizes, device_type=info.device.type)
    return DistributedSetup(
        mesh=mesh, section=section, rank=info.rank, world_size=info.world_size, device=info.device
    )
