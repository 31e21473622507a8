"""The YAML ``distributed:`` section -> validated settings -> `MeshContext`.

YAML distributed section
  -> parse_distributed_section()   every registered parallelism's size key and own section
                                   (`automodel.recipes.parallelisms`: pipeline -> PipelineConfig,
                                   moe -> MoEParallelizerConfig) or own flat keys (sequence_parallel,
                                   tp_plan -> TensorParallelConfig), the strategy's config from the
                                   other flags, built by their packages (the same on every machine);
                                   the strategy's allow-list of parallelisms (`Strategy.supported_axes`),
                                   its `check_sizes`, then each parallelism's `check_sizes`, then the
                                   strategy's `check_parallelism_config` of each typed config
  -> resolve_machine_defaults()    at launch: the flags left to the machine (bf16 on CUDA, nccl/gloo)
  -> setup_distributed()           process group and MeshContext
  -> recipes.parallelize           applies them to the model (composition order: see its docstring)

The section's type, `DistributedSection`, is in the config leaf (`config/distributed.py`); this
module builds it (it needs the strategy and parallelism registries, which the leaf may not import).
Each flag's own rule (type, range) lives in its package's config class; a parallelism's rules
against the other sizes in its `Parallelism.check_sizes`, against the model in its `check_model`
(run by `rules.py`); only the strategy's allow-list of parallelisms is read here.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from automodel.mesh import (
    MeshContext,
    ParallelismSizes,
    ResolvedLayout,
    axes,
    init_distributed,
    parse_dtype,
)
from automodel.recipes.config.distributed import DistributedSection
from automodel.recipes.errors import ConfigError, reject_unknown
from automodel.recipes.instantiate import instantiate
from automodel.recipes.parallelisms import config_error, parallelisms, section_keys, size_keys
from automodel.recipes.parallelisms.base import section_mapping
from automodel.recipes.strategies import Strategy, get_strategy, strategy_names, world_of_one_strategy


def _mesh_size_keys() -> frozenset[str]:
    """The `ParallelismSizes` keys: the size keys of the mesh axes (`automodel.mesh.axes`); the
    other registered parallelisms' sizes are `DistributedSection.other_sizes`."""
    return frozenset(a.size_key for a in axes() if a.size_key is not None)


def strategy_flags(strategy: str) -> tuple[str, ...]:
    """Keys the strategy accepts besides the sizes: its config class's constructor arguments."""
    return tuple(inspect.signature(get_strategy(strategy).config_class()).parameters)


def common_keys() -> tuple[str, ...]:
    """The section's keys besides the strategy flags: the strategy, every registered parallelism's
    size key and options section."""
    return ("strategy", *size_keys(), *section_keys())


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
    backend = section.strategy_config.backend
    return dataclasses.replace(
        section,
        strategy=alone.name,
        strategy_config=alone.config_class()(**({} if backend is None else {"backend": backend})),
        chosen_because=f"a world of one shards nothing, so no {section.strategy} wrapping "
        f"(distributed.strategy unset; set it to {section.strategy} to wrap)",
    )


def check_supported_axes(strategy: Strategy, sizes: Mapping[str, int | None]) -> None:
    """Every parallelism the sizes ask for is on the strategy's allow-list (`Strategy.supported_axes`)."""
    for parallelism in parallelisms():
        value = sizes[parallelism.size_key]
        if parallelism.name not in strategy.supported_axes and parallelism.in_use(value):
            raise ConfigError(
                f"distributed.{parallelism.size_key}", value, strategy.axis_refusal(parallelism)
            )


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
    common = common_keys()
    reject_unknown("distributed", data, set(common) | every_flag)
    for key in data:
        if key not in common and key not in flags:
            raise ConfigError(f"distributed.{key}", data[key], f"is not an option of strategy {strategy!r}")
    given = {k: instantiate(v, key=f"distributed.{k}") for k, v in data.items() if k not in common}
    # a parallelism's flat keys (tp's sequence_parallel, tp_plan) are its config's, not the strategy's
    owned = {k for p in parallelisms() for k in p.flag_keys}
    options = {k: v for k, v in given.items() if k not in owned}
    strategy_config = build_strategy_config(strategy, options)
    sizes = {p.size_key: p.parse_size(data) for p in parallelisms()}

    check_supported_axes(get_strategy(strategy), sizes)
    get_strategy(strategy).check_sizes(sizes, options, strategy_config)
    for parallelism in parallelisms():
        parallelism.check_sizes(sizes=sizes, data=data, strategy_config=strategy_config)

    try:
        psizes = ParallelismSizes(**{k: v for k, v in sizes.items() if k in _mesh_size_keys()})
    except ValueError as e:  # pragma: no cover - every size was checked above
        raise ConfigError("distributed", sizes, str(e)) from None
    configs: dict[str, object] = {}
    for parallelism in parallelisms():
        key = parallelism.section_key
        own = None if key is None else section_mapping(data, key)
        if parallelism.flag_keys:
            own = {**(own or {}), **{k: given[k] for k in parallelism.flag_keys if k in given}}
        built = parallelism.build_config(
            own, size=sizes[parallelism.size_key], local_batch_size=local_batch_size
        )
        if built is not None:  # under its YAML section's key (`DistributedSection.parallelism_configs`)
            get_strategy(strategy).check_parallelism_config(built, options=own or {})
            configs[key if key is not None else parallelism.name] = built
    machine_keys = frozenset(k for k in get_strategy(strategy).machine_keys if options.get(k) is None)
    return DistributedSection(
        strategy=strategy,
        sizes=psizes,
        strategy_config=strategy_config,
        machine_keys=machine_keys,
        parallelism_configs=configs,
        other_sizes={k: v or 1 for k, v in sizes.items() if k not in _mesh_size_keys()},
        explicit_flags=frozenset(options),
        strategy_given="strategy" in data or any(k != "backend" for k in given),
    )


def resolve_layout(section: DistributedSection, world_size: int) -> ResolvedLayout:
    """Every divisibility rule of the sizes against `world_size`, as a `ConfigError`."""
    try:
        layout = section.sizes.resolve(world_size)
    except ValueError as e:
        # every size of the axis table, as the YAML sets it (None: derived), and the world size
        sizes = " ".join(f"{key.removesuffix('_size')}={v}" for key, v in section.sizes.as_dict().items())
        value = f"{sizes} world={world_size}"
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
