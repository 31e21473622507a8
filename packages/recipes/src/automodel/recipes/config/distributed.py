"""`DistributedSection`: the parsed ``distributed:`` section (built by `_dist_setup.parse_distributed_section`
with the strategy and parallelism registries; this module holds only its type)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from automodel.mesh import ParallelismSizes, StrategyConfig

if TYPE_CHECKING:  # the pipeline's import costs ~1.7 s of start-up: its type is named only
    from automodel.moe import MoEParallelizerConfig
    from automodel.pipeline import PipelineConfig


@dataclass(frozen=True)
class DistributedSection:
    """The parsed ``distributed:`` section, every part built by its package: the sizes, the
    strategy's config (its flags), automodel.fsdp2's `TensorParallelConfig` (tensor and sequence
    parallelism's keys: read through `parallelisms.tp.tensor_parallel_config`), automodel.pipeline's `PipelineConfig` (pp_size > 1) and automodel.moe's
    `MoEParallelizerConfig` (ep_size > 1)."""

    strategy: str
    sizes: ParallelismSizes
    strategy_config: StrategyConfig
    #: Strategy flags the YAML left to the machine; `resolve_machine_defaults` fills them at launch
    #: (empty afterwards).
    machine_keys: frozenset[str] = frozenset()
    #: Each registered parallelism's typed config, by the key of its own YAML section
    #: (`Parallelism.section_key`: ``pipeline``, `PipelineConfig` when pp_size > 1; ``moe``,
    #: `MoEParallelizerConfig` when ep_size > 1), else by its name when its keys are flat
    #: ``distributed:`` keys (``tp``: `TensorParallelConfig`), so the accessors below name the
    #: section they read, not a parallelism (this leaf module cannot ask the registry).
    parallelism_configs: Mapping[str, object] = field(default_factory=dict)
    #: Sizes of registered parallelisms that form no mesh axis (size key -> size; 1 when unset).
    other_sizes: Mapping[str, int] = field(default_factory=dict)
    #: The strategy flags the YAML set (the others are the config class's defaults).
    explicit_flags: frozenset[str] = frozenset()
    #: False when the YAML named no strategy and no strategy flag (a world of one may then get the
    #: world-of-one strategy, `resolve_machine_defaults`).
    strategy_given: bool = True
    #: Why `resolve_machine_defaults` chose the strategy, when the YAML did not (the start-up line).
    chosen_because: str | None = None

    @property
    def pipeline_config(self) -> PipelineConfig | None:
        """automodel.pipeline's config (``distributed.pipeline``) when pp_size > 1."""
        return cast("PipelineConfig | None", self.parallelism_configs.get("pipeline"))

    @property
    def moe_config(self) -> MoEParallelizerConfig | None:
        """automodel.moe's config (``distributed.moe``) when ep_size > 1."""
        return cast("MoEParallelizerConfig | None", self.parallelism_configs.get("moe"))
