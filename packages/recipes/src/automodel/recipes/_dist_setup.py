"""The YAML ``distributed:`` section -> validated settings -> `MeshContext`.

YAML distributed section
  -> parse_distributed_section()   sizes; the strategy's, pipeline's and moe's configs built by
                                   their packages (the same on every machine); the rules that tie
                                   the strategy to the sizes (the strategy's `check_sizes`)
  -> resolve_machine_defaults()    at launch: the flags left to the machine (bf16 on CUDA, nccl/gloo)
  -> setup_distributed()           process group and MeshContext
  -> recipes.parallelize           applies them to the model (composition order: see its docstring)

Each flag's own rule (type, range) lives in its package's config class; only rules across the
strategy and the sizes live here, and rules that need the model or the batch in `rules.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from automodel.mesh import MeshContext, ParallelismSizes, ResolvedLayout, init_distributed, parse_dtype
from automodel.moe import MoEParallelizerConfig
from automodel.recipes.errors import ConfigError, reject_unknown
from automodel.recipes.instantiate import instantiate
from automodel.recipes.strategies import get_strategy, strategy_names, world_of_one_strategy

SIZE_KEYS = ("dp_size", "dp_replicate_size", "tp_size", "pp_size", "cp_size", "ep_size")
COMMON_KEYS = ("strategy", *SIZE_KEYS, "pipeline", "moe")


def strategy_flags(strategy: str) -> tuple[str, ...]:
    """Keys the strategy accepts besides the sizes: its config class's constructor arguments."""
    return tuple(inspect.signature(get_strategy(strategy).config_class()).parameters)


def config_error(prefix: str, options: dict[str, Any], error: Exception) -> ConfigError:
    """A package config's ValueError/TypeError as a `ConfigError` naming the YAML key it is about."""
    msg = str(error)
    key = next(
        (k for k in options if msg.startswith(k) or f"{k} " in msg or f"{k}." in msg or f"{k}=" in msg), None
    )
    return ConfigError(f"{prefix}.{key}", options[key], msg) if key else ConfigError(prefix, options, msg)


def build_strategy_config(strategy: str, options: dict[str, Any]) -> Any:
    """The strategy's config dataclass from the section's flags (YAML names, errors name the key).

    The same on every machine: the flags the YAML leaves to the machine (`Strategy.machine_keys`)
    keep the package defaults until `resolve_machine_defaults` fills them at launch.
    """
    try:
        return get_strategy(strategy).config_class()(**options)
    except (ValueError, TypeError) as e:
        raise config_error("distributed", options, e) from None


def resolve_machine_defaults(
    section: DistributedSection, *, cuda: bool, world_size: int | None = None, param_dtype: Any = None
) -> DistributedSection:
    """The one place machine-dependent defaults are decided, at launch on the machine that runs:
    the flags the YAML left out (`DistributedSection.machine_keys`) get this machine's values
    (FSDP2: bf16 mixed precision on CUDA, full precision on CPU; backend nccl with CUDA, else gloo).

    A world of one (`world_size` 1) whose YAML names no strategy and no strategy flag gets the
    registered world-of-one strategy (`strategies.single`: no FSDP wrapping) when the default
    strategy would change nothing there (`Strategy.needed_alone` for parameters of `param_dtype`,
    ``model.dtype``); `DistributedSection.chosen_because` says why."""
    if section.machine_keys:
        config = get_strategy(section.strategy).with_machine_defaults(
            section.strategy_config, keys=section.machine_keys, cuda=cuda
        )
        section = dataclasses.replace(section, strategy_config=config, machine_keys=frozenset())
    alone = world_of_one_strategy()
    if section.strategy_given or world_size != 1 or alone is None:
        return section
    dtype = parse_dtype(param_dtype, key="model.dtype") or torch.float32
    if get_strategy(section.strategy).needed_alone(section.strategy_config, param_dtype=dtype):
        return section
    backend = getattr(section.strategy_config, "backend", None)
    return dataclasses.replace(
        section,
        strategy=alone.name,
        strategy_config=alone.config_class()(**({} if backend is None else {"backend": backend})),
        chosen_because=f"a world of one shards nothing, so no {section.strategy} wrapping "
        f"(distributed.strategy unset; set it to {section.strategy} to wrap)",
    )


def build_moe_config(moe: dict[str, Any] | None) -> Any:
    """`MoEParallelizerConfig` from ``distributed.moe`` (errors name the key)."""
    options = dict(moe or {})
    try:
        return MoEParallelizerConfig(**options)
    except (ValueError, TypeError) as e:
        raise config_error("distributed.moe", options, e) from None


def build_pipeline_config(pipeline: dict[str, Any] | None, *, local_batch_size: int) -> Any:
    """`PipelineConfig` from ``distributed.pipeline``; one pipeline step takes one local batch."""
    # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
    from automodel.pipeline import PipelineConfig

    options = dict(pipeline or {})
    if "pp_batch_size" in options and options["pp_batch_size"] != local_batch_size:
        raise ConfigError(
            "distributed.pipeline.pp_batch_size",
            options["pp_batch_size"],
            f"must equal step_scheduler.local_batch_size={local_batch_size} (or be left out)",
        )
    options["pp_batch_size"] = local_batch_size
    try:
        return PipelineConfig(**options)
    except (ValueError, TypeError) as e:
        if str(e).startswith("pp_batch_size="):  # the pipeline's batch is the local batch
            raise ConfigError(
                "step_scheduler.local_batch_size",
                local_batch_size,
                f"must be a multiple of distributed.pipeline.pp_microbatch_size={options.get('pp_microbatch_size')}",
            ) from None
        raise config_error("distributed.pipeline", options, e) from None


@dataclass(frozen=True)
class DistributedSection:
    """The parsed ``distributed:`` section, every part built by its package: the sizes, the
    strategy's config (its flags), automodel.pipeline's `PipelineConfig` (pp_size > 1) and
    automodel.moe's `MoEParallelizerConfig` (ep_size > 1)."""

    strategy: str
    sizes: ParallelismSizes
    strategy_config: Any
    #: Strategy flags the YAML left to the machine; `resolve_machine_defaults` fills them at launch
    #: (empty afterwards).
    machine_keys: frozenset[str] = frozenset()
    pipeline_config: Any = None
    moe_config: Any = None
    #: The strategy flags the YAML set (the others are the config class's defaults).
    explicit_flags: frozenset[str] = frozenset()
    #: False when the YAML named no strategy and no strategy flag (a world of one may then get the
    #: world-of-one strategy, `resolve_machine_defaults`).
    strategy_given: bool = True
    #: Why `resolve_machine_defaults` chose the strategy, when the YAML did not (the start-up line).
    chosen_because: str | None = None

    @property
    def sequence_parallel(self) -> bool:
        return bool(getattr(self.strategy_config, "sequence_parallel", False))

    @property
    def tp_plan(self) -> Any:
        """The YAML's custom TP plan (None: the model's own HF plan, else the Llama default)."""
        config = self.strategy_config
        return getattr(config, "custom_tp_plan", getattr(config, "tp_plan", None))


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


def parse_distributed_section(data: Any, *, local_batch_size: int = 1) -> DistributedSection:
    """Validate the section (keys, flags, strategy-vs-sizes rules); `ConfigError` names the key.

    `local_batch_size` (``step_scheduler.local_batch_size``) is the pipeline's batch."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("distributed", data, "must be a mapping")
    strategy = data.get("strategy", "fsdp2")
    if strategy not in strategy_names():
        raise ConfigError("distributed.strategy", strategy, f"must be one of {', '.join(strategy_names())}")
    flags = strategy_flags(strategy)
    every_flag = {flag for name in strategy_names() for flag in strategy_flags(name)}
    reject_unknown("distributed", data, set(COMMON_KEYS) | every_flag)
    for key in data:
        if key not in COMMON_KEYS and key not in flags:
            raise ConfigError(f"distributed.{key}", data[key], f"is not an option of strategy {strategy!r}")
    options = {k: instantiate(v, key=f"distributed.{k}") for k, v in data.items() if k not in COMMON_KEYS}
    strategy_config = build_strategy_config(strategy, options)
    sizes = {k: _size(data, k) for k in SIZE_KEYS}
    tp, pp, ep = sizes["tp_size"], sizes["pp_size"], sizes["ep_size"]
    sp = bool(getattr(strategy_config, "sequence_parallel", False))

    get_strategy(strategy).check_sizes(sizes, options, strategy_config)
    if sp and tp == 1:
        raise ConfigError(
            "distributed.sequence_parallel", sp, "needs tp_size > 1 (sequence parallelism splits TP regions)"
        )

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
    machine_keys = frozenset(k for k in get_strategy(strategy).machine_keys if options.get(k) is None)
    return DistributedSection(
        strategy=strategy,
        sizes=psizes,
        strategy_config=strategy_config,
        machine_keys=machine_keys,
        pipeline_config=None
        if pipeline is None
        else build_pipeline_config(pipeline, local_batch_size=local_batch_size),
        moe_config=build_moe_config(moe) if ep > 1 else None,
        explicit_flags=frozenset(options),
        strategy_given="strategy" in data or any(k != "backend" for k in options),
    )


def resolve_layout(section: DistributedSection, world_size: int) -> ResolvedLayout:
    """Every divisibility rule of the sizes against `world_size`, as a `ConfigError`."""
    try:
        layout = section.sizes.resolve(world_size)
    except ValueError as e:
        s = section.sizes
        value = (
            f"tp={s.tp_size} pp={s.pp_size} cp={s.cp_size} ep={s.ep_size} dp={s.dp_size} world={world_size}"
        )
        raise ConfigError("distributed", value, str(e)) from None
    get_strategy(section.strategy).check_layout(layout)
    return layout


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
