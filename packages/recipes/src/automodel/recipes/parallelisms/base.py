"""The parallelism interface: what one parallelism (data parallel shard and replicate, tp, cp, pp,
ep, or a new one) owns in the recipes.

A parallelism names its ``distributed.<size_key>`` YAML key (and its own options section, parsed
into its package's typed config), its rules against the other sizes and against the model, the
line the layout report prints for it and what a checkpoint records of it. The section parser,
`rules.check_layout_rules`, the layout report, the checkpoint's layout and the strategies'
allow-lists (`Strategy.supported_axes`) iterate the registry (`registry.py`) instead of naming axes.

For `recipes plan` / `recipes validate` it owns its terms of the estimates: the share of the model
and of the activations it leaves a rank (`memory_shares`), the tensors it adds to a layer's saved
activations (`layer_activation_terms`), the places of a schedule it runs (`memory_positions`),
bytes it holds all step (`memory_terms`), its exposed communication (`exposed_comm_s`), the sizes
and options the search tries (`search_order`, `search_sizes`, `search_options`) and its column,
YAML and report lines. What the data-parallel strategy keeps is the strategy's
(`Strategy.memory_model`). A new parallelism is one module subclassing `Parallelism` plus one
`register_parallelism` call.
"""

from __future__ import annotations

import contextlib
from abc import ABC
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Generic, Literal, Protocol, TypeVar

import torch

from automodel.mesh import MeshContext, ResolvedLayout, StrategyConfig, parallel_axes
from automodel.recipes.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.moe import ExpertShardUnit, MoEParallelizerConfig
    from automodel.pipeline import BoundaryLayout
    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.shape import ModelShape
    from automodel.recipes.planning.step import StepSetup, StepTraffic

#: One rank's layout report (`automodel.mesh.layout_report.rank_report`): JSON-like values.
RankReport = Mapping[str, object]
#: The options under a parallelism's own section key (``distributed.pipeline``), as YAML gives them.
Options = Mapping[str, object]

_UNSET = ("none", "null", "auto")

#: Outcomes of the model-dependent checks of one meta-device model, by what they depend on (the
#: error message, or None): `recipes plan` checks many layouts of one model and passes one memo.
ModelChecks = dict[tuple[object, ...], str | None]
#: The meta-device model, built on the first call (a check that needs none builds none).
MetaModel = Callable[[], torch.nn.Module]


def checked_once(
    memo: ModelChecks | None,
    key: tuple[object, ...],
    check: Callable[[], object],
    *,
    errors: type[Exception] | tuple[type[Exception], ...] = ValueError,
) -> str | None:
    """The message of the `errors` `check` raises (None if it passes), run once per `key` of `memo`."""
    if memo is not None and key in memo:
        return memo[key]
    try:
        check()
        message = None
    except errors as e:
        message = str(e)
    if memo is not None:
        memo[key] = message
    return message


#: The kernels a parallelism may refuse to compose with (`Parallelism.kernel_refusal`).
KernelKind = Literal["liger", "float8"]

#: A context manager factory a micro-batch's forward and backward run inside.
BatchContext = Callable[[], contextlib.AbstractContextManager[object]]


#: What the parallelisms resolved when the strategy applied them, by parallelism name, for the
#: loop and the layout report (cp: its attention backend; pp: the built pipeline); each parallelism
#: reads and writes only its own entry, so nothing outside it names what it resolved.
Resolved = Mapping[str, object]


class LoopModel(Protocol):
    """What the training loop's model (`strategies.base.ParallelModel`) shows a parallelism's loop
    hooks: a Protocol, so the parallelisms import no strategy (the strategies import them)."""

    @property
    def resolved(self) -> Resolved:
        """What each parallelism resolved when it was applied (`Resolved`)."""
        ...


class StepMeter(Protocol):
    """What a parallelism records over one real training step (`Parallelism.step_meter`): entered
    around the step, then `fields` (a collective over its group: every rank calls it) gives the
    `StepSetup` fields the estimate takes as run-time facts (ep: ``expert_load_factor``)."""

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> None: ...

    def fields(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as this rank's model takes it: its tensors, the extra model keyword
    arguments, and the context its forward and backward run in (`Parallelism.shard_batch`)."""

    fields: dict[str, torch.Tensor]
    extra: dict[str, object] = field(default_factory=dict)
    context: BatchContext = contextlib.nullcontext


@dataclass(frozen=True)
class BatchRun:
    """What the training loop knows that a batch transform needs."""

    mesh: MeshContext
    #: What each parallelism resolved when it was applied (`Resolved`: cp's attention backend).
    resolved: Resolved
    pad_token_id: int
    #: Rows are packed documents (positions restart at 0 per document).
    packed: bool


@dataclass
class StageBuild:
    """One model part (the model, or a pipeline stage) between the model-parallel phases of the
    composition (`Parallelism.apply_to_stage`, in `apply_phase` order) and the data-parallel
    sharding that follows: what the strategy handed them, and what they leave it."""

    mesh: MeshContext
    #: The strategy's flags (FSDP2's, for the phases that run inside its stack).
    strategy_config: StrategyConfig
    #: The ``distributed.moe`` options (`automodel.moe.MoEParallelizerConfig`), None without EP.
    moe_config: MoEParallelizerConfig | None
    gradient_divide_factor: float | None
    #: The part is one of the parts a parallelism split the model into (`Parallelism.split_model`:
    #: a pipeline stage, which may hold dense layers only).
    pipeline_stage: bool
    #: Left by the phases: what each resolved for the loop, by its name (`Resolved`: cp's attention
    #: backend) ...
    resolved: dict[str, object] = field(default_factory=dict)
    #: ... and the expert units EP split off, which the sharding wraps apart (None: EP did not run).
    expert_units: list[ExpertShardUnit] | None = None
    #: Each parallelism's typed config, by its name (`DistributedSection.parallelism_configs`): a
    #: phase reads its own (tp: its `TensorParallelConfig`).
    parallelism_configs: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSplit:
    """What the strategy hands the parallelism that splits the model into parts over its ranks
    (`Parallelism.split_model`: the pipeline's stages), built on the meta device."""

    mesh: MeshContext
    section: DistributedSection
    device: torch.device
    #: The loss a schedule that runs the micro-batches itself calls (None: none given).
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    #: The strategy's per-part composition (the phases, then the sharding), applied to each part.
    build_part: Callable[[torch.nn.Module], None]


@dataclass(frozen=True)
class MemoryShares:
    """How much of one rank's model and activations a parallelism leaves it, as divisors of the
    whole (1: all of it); the memory estimate multiplies every registered parallelism's shares
    (`registry.memory_shares`), so a new parallelism scales the estimate without editing it."""

    #: Decoder layers (and their activations) on this rank: pp.
    layers: int = 1
    #: Tokens of each sequence on this rank: cp.
    tokens: int = 1
    #: Attention heads, MLP width, the untied vocabulary head, dense layer weights: tp.
    heads: int = 1
    #: Hidden-state width saved between the TP regions (sequence parallelism): tp with SP.
    norm_width: int = 1
    #: The routed experts' weights: ep (tp without ep).
    experts: int = 1
    #: Multiplier (not a divisor): the busiest rank's routed slots over its balanced share.
    expert_load: float = 1.0

    def times(self, other: MemoryShares) -> MemoryShares:
        """Both parallelisms' shares at once (the sizes multiply: integer products stay exact)."""
        return MemoryShares(
            layers=self.layers * other.layers,
            tokens=self.tokens * other.tokens,
            heads=self.heads * other.heads,
            norm_width=self.norm_width * other.norm_width,
            experts=self.experts * other.experts,
            expert_load=self.expert_load * other.expert_load,
        )


@dataclass(frozen=True)
class RankPosition:
    """One rank's place in a schedule that splits the model over ranks and runs micro-batches
    through them (the pipeline's stages); the memory estimate takes the worst of the positions a
    parallelism names (`Parallelism.memory_positions`). The defaults: the whole model, one batch."""

    holds_embedding: bool = True
    holds_head: bool = True
    #: The micro-batches run inside the schedule (forward and backward interleaved): every layer
    #: keeps its gathered weights, the loop holds no logits, gradients are not kept unsharded.
    scheduled: bool = False
    #: Rows of one micro-batch (None: the local batch), micro-batches per local batch.
    micro_batch_rows: int | None = None
    micro_batches: int = 1
    #: Micro-batches whose saved activations (of all the rank's layers) are alive at once.
    in_flight: float = 1.0
    #: Stage boundaries the rank sends and receives one micro-batch's hidden states across (two
    #: buffers each).
    p2p_stages: int = 0


#: Where in a decoder layer's saved activations a parallelism adds bytes per token: after the
#: norms, after attention, after the routed experts (the estimate's order of addition).
ActivationSite = Literal["norms", "attention", "experts"]


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending (the sizes a search tries)."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class SearchPoint:
    """Where `recipes plan`'s search stands when it asks a parallelism which sizes to try."""

    shape: ModelShape
    gpus: int
    gpus_per_node: int
    #: The sizes chosen so far, by parallelism name (the earlier `search_order`s).
    sizes: Mapping[str, int]
    #: Ranks the dense mesh axes chosen so far leave: gpus over their product.
    room: int


@dataclass(frozen=True)
class PlanColumn:
    """A searched parallelism's column in `recipes plan`'s table."""

    header: str
    width: int
    #: The format alignment: ``>`` (numbers) or ``<``.
    align: str = ">"


def is_shard_placement(placement: str) -> bool:
    """Whether a placement as the report writes it shards: ``S(d)``, the strided ``_S(d, k)`` FSDP
    puts on top of TP (older torch: ``Shard(dim=d)``), as opposed to ``R`` or ``P(...)``."""
    return placement.startswith(("S(", "_S(", "Shard(", "_StridedShard("))


def sharded_on(info: Mapping[str, object], axis: str) -> bool:
    """Whether a parameter of the layout report is sharded along mesh `axis`."""
    mesh = info.get("mesh") or []
    placements = info.get("placements") or []
    assert isinstance(mesh, list) and isinstance(placements, list)
    return axis in mesh and is_shard_placement(str(placements[mesh.index(axis)]))


def report_parameters(report: RankReport) -> list[Mapping[str, object]]:
    """Every parameter entry of the report, over all its parts."""
    parts = report["parts"]
    assert isinstance(parts, list)
    return [info for part in parts for info in part["parameters"].values()]


def config_error(prefix: str, options: Mapping[str, object], error: Exception) -> ConfigError:
    """A package config's ValueError/TypeError as a `ConfigError` naming the YAML key it is about."""
    msg = str(error)
    key = next(
        (k for k in options if msg.startswith(k) or f"{k} " in msg or f"{k}." in msg or f"{k}=" in msg), None
    )
    return ConfigError(f"{prefix}.{key}", options[key], msg) if key else ConfigError(prefix, options, msg)


def section_mapping(data: Mapping[str, object], key: str) -> Mapping[str, object] | None:
    """``distributed.<key>`` as a mapping, None when absent (`ConfigError` for another value)."""
    value = data.get(key)
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"distributed.{key}", value, "must be a mapping")
    return value


#: A parallelism's typed config, from its own section (None for one without a section).
C = TypeVar("C")


class Parallelism(ABC, Generic[C]):
    """One parallelism over its config class `C` (``Parallelism[None]``: it has no section);
    subclasses set `name` and `size_key` and override the hooks that apply."""

    #: What strategies list it as (`Strategy.supported_axes`); its mesh axis when the mesh has one
    #: of that name (`automodel.mesh.axes`).
    name: ClassVar[str]
    #: The ``distributed.<size_key>`` YAML key of its size.
    size_key: ClassVar[str]
    #: Its own options section, ``distributed.<section_key>`` (None: it has none).
    section_key: ClassVar[str | None] = None
    #: Its options written as flat keys of ``distributed:`` (NeMo AutoModel's YAML: tp's
    #: ``sequence_parallel``, ``tp_plan``): the section parser hands them to `build_config` instead
    #: of to the strategy. A strategy accepts one when its config class takes it (its package's
    #: config keeps AutoModel's fields for the package's own users); others refuse it as not their
    #: option.
    flag_keys: ClassVar[tuple[str, ...]] = ()
    #: An unset size (``none`` / ``auto``) is derived from the world size (data parallel).
    derived_when_unset: ClassVar[bool] = False
    #: What a strategy that does not support it accepts (for the refusal's message).
    unused: ClassVar[str] = "1"
    #: Mesh axes whose sharded parameters the layout report counts for it, in report order.
    report_axes: ClassVar[tuple[str, ...]] = ()

    #: Mesh roles (`roles.mesh_roles`): its axis splits each batch's rows (the batch rank, the
    #: label-token count's sum); splits each row's tokens (joins the loss sum); its ranks hold
    #: different plain parameters (the gradient norm's sum).
    splits_rows: ClassVar[bool] = False
    splits_tokens: ClassVar[bool] = False
    holds_distinct_parameters: ClassVar[bool] = False
    #: Its axis splits the rows and its ranks hold whole copies of what a sharding strategy shards
    #: over the other row-splitting axes (HSDP's replicas: `roles.shard_axis`).
    holds_whole_copies: ClassVar[bool] = False

    # ---- the YAML ------------------------------------------------------------------------
    @property
    def mesh_axis(self) -> str | None:
        """The mesh axis it sizes, None for one that forms no mesh axis. A checkpoint records the
        mesh axes' sizes (`automodel.mesh.parallel_axes`) and DCP reshards across all of them, so
        a checkpoint restores under any other layout."""
        return self.name if self.name in parallel_axes() else None

    def parse_size(self, data: Mapping[str, object]) -> int | None:
        """Its size from the ``distributed:`` mapping: an int >= 1 (default 1), or None when unset
        and `derived_when_unset`."""
        key = self.size_key
        value = data.get(key, None if self.derived_when_unset else 1)
        if self.derived_when_unset and (
            value is None or (isinstance(value, str) and value.lower() in _UNSET)
        ):
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"distributed.{key}",
                value,
                "must be an int >= 1" + (" or none" if self.derived_when_unset else ""),
            )
        return value

    def in_use(self, size: int | None) -> bool:
        """Whether `size` asks for this parallelism (a strategy that does not list it refuses it)."""
        return size is not None and size > 1

    def config_class(self) -> type[C] | None:
        """The frozen dataclass `build_config` returns (None: it has no section); read by the test
        that every config reachable from a recipe is frozen."""
        return None

    def build_config(self, options: Options | None, *, size: int | None, local_batch_size: int) -> C | None:
        """Its typed config from its own section, or from its `flag_keys` that the YAML set (None:
        it has none, or it is off)."""
        return None

    # ---- rules ---------------------------------------------------------------------------
    def check_sizes(
        self, *, sizes: Mapping[str, int | None], data: Mapping[str, object], strategy_config: StrategyConfig
    ) -> None:
        """Rules across its size and the other sizes or flags (`ConfigError` naming the key)."""
        return None

    def size(self, section: DistributedSection, layout: ResolvedLayout) -> int:
        """Its resolved size: the mesh axis's, else the section's parsed value."""
        axis = self.mesh_axis
        if axis is not None:
            return layout.axis_size(axis)
        return section.other_sizes.get(self.size_key, 1)

    def sequence_divisor(self, *, section: DistributedSection, layout: ResolvedLayout, size: int) -> int:
        """What a sequence length must be a multiple of for it (`roles.sequence_length_divisor`
        folds them; `check_model` refuses a ``seq_length`` that is not one, and an SFT micro-batch
        padded to its longest example is rounded up to it); 1 by default."""
        return 1

    def check_model(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig, size: int
    ) -> None:
        """Rules against the model and the batch, run before launch (`rules.check_layout_rules`)."""
        return None

    def check_meta_model(
        self,
        *,
        cfg: RecipeConfig,
        layout: ResolvedLayout,
        hf_config: PretrainedConfig,
        size: int,
        meta_model: MetaModel,
        memo: ModelChecks | None,
    ) -> None:
        """The check its package runs when the ranks apply it, run once on the meta-device model
        before launch (`rules.check_model_supports_layout`): a model it cannot be applied to exactly
        is refused here, naming the model and why. `meta_model()` builds the model on first use;
        `memo` keeps outcomes across the layouts `recipes plan` checks (`checked_once`). None by
        default."""
        return None

    def cannot_apply(self, size: int, why: str) -> ConfigError:
        """The refusal of `check_meta_model`: its size key cannot be applied to the model, and why
        (one wording for every parallelism: ``distributed.<size_key>=N: cannot be applied: why``)."""
        return ConfigError(f"distributed.{self.size_key}", size, f"cannot be applied: {why}")

    def check_files(self, *, cfg: RecipeConfig) -> None:
        """The files its section names exist on this machine (`ConfigError` naming the key): run
        before any rank starts, with the other checks of this machine (`environment.check_environment`;
        the typed config reads no disk); none by default."""
        return None

    def kernel_refusal(self, kernel: KernelKind) -> tuple[str, str] | None:
        """Why `kernel` (Liger's kernels, float8 linears) does not compose with it when in use, as
        ``(what it is, why)`` for the refusal naming its size key (`kernels.checks`); None: it does."""
        return None

    # ---- the planner ---------------------------------------------------------------------
    def step_fields(self, *, section: DistributedSection, size: int, stages: int) -> dict[str, object]:
        """The `StepSetup` fields besides its size that a run of `section` sets for it, as `recipes
        train` runs it (`planning.setup.step_setup`: pp's micro-batch, schedule and stages per rank,
        ep's resharding, tp's sequence parallelism); `section` has the machine's defaults resolved,
        `stages` is the pipeline's stage count. None by default."""
        return {}

    def memory_terms(self, *, size: int, setup: StepSetup, shape: ModelShape) -> dict[str, float]:
        """Per-rank bytes it holds through the whole step, by name (added to the static part of
        the estimate, `StepSetup.extra_bytes`); none by default."""
        return {}

    def memory_shares(self, *, size: int, setup: StepSetup, shape: ModelShape) -> MemoryShares:
        """The share of the model and of the activations it leaves each rank (`MemoryShares`);
        all of it by default. `size` is its size in `setup` (`StepSetup.size_of`)."""
        return MemoryShares()

    def memory_positions(self, *, size: int, setup: StepSetup) -> tuple[RankPosition, ...] | None:
        """The ranks' places in its schedule whose peaks the estimate compares (None: it runs
        none; the first parallelism that names positions decides them)."""
        return None

    def expert_shard_ranks(self, *, size: int, setup: StepSetup) -> int | None:
        """The ranks the data-parallel sharding spreads the expert weights it split off over, when
        they are wrapped apart from the dense weights (ep: ``ep_shard``); None: it splits none off
        (the experts are sharded with the dense weights). The first parallelism that names some
        decides (`planning.terms.expert_shard_ranks`)."""
        return None

    def layer_activation_terms(
        self, *, size: int, setup: StepSetup, shape: ModelShape, shares: MemoryShares, moe: bool
    ) -> dict[ActivationSite, float]:
        """Bytes per token (of this rank) one decoder layer saves for backward because of it, by
        where they add up; `shares` are every parallelism's together, `moe` whether the layer
        routes to experts. None by default."""
        return {}

    #: Its place in `recipes plan`'s search (outermost first) and in its table and YAML; None:
    #: the planner leaves it at 1.
    search_order: ClassVar[int | None] = None
    #: Its column in `recipes plan`'s table (default: its name, 3 wide).
    plan_column: ClassVar[PlanColumn | None] = None

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        """The assignments `recipes plan` tries at `point`, each ``{name: size}`` (one may also
        resize a parallelism chosen earlier: HSDP splits dp_shard); by default every divisor of
        the room left."""
        return [{self.name: d} for d in divisors(point.room)]

    def search_options(self, *, size: int, shape: ModelShape) -> list[dict[str, object]]:
        """The `StepSetup` fields `recipes plan` tries with each of its sizes (pp's schedules,
        ep's resharding, tp's sequence parallelism), each a set of overrides; one, none changed,
        by default."""
        return [{}]

    def search_local_batches(self, *, size: int) -> tuple[int, ...] | None:
        """The local batch sizes `recipes plan` tries at its size (None: the planner's own; the
        first parallelism that gives some decides)."""
        return None

    def plan_cell(self, setup: StepSetup) -> str:
        """Its cell in `recipes plan`'s table: its size."""
        return str(setup.size_of(self.name))

    def plan_yaml(self, setup: StepSetup) -> list[str]:
        """Its ``distributed:`` lines in the YAML `recipes plan` proposes: the size key when > 1."""
        size = setup.size_of(self.name)
        return [f"  {self.size_key}: {size}"] if size > 1 else []

    def plan_yaml_section(self, setup: StepSetup) -> list[str]:
        """Its own options section in that YAML (``pipeline:``, ``moe:``), after the flags."""
        return []

    def validate_lines(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, size: int, stages: int, setup: StepSetup
    ) -> list[str]:
        """What `recipes validate` says of it under the model line (the pipeline's schedule, the
        expert load the estimate assumed); `setup` is the estimate's. Nothing by default."""
        return []

    def bubble_s(self, *, compute_s: float, setup: StepSetup) -> float:
        """Seconds its schedule leaves ranks idle in a step of `compute_s` seconds of compute (the
        roofline, `planning.roofline`); none by default."""
        return 0.0

    def exposed_comm_s(self, traffic: StepTraffic) -> float:
        """Seconds its collectives add to one step on the critical path (the roofline of `recipes
        plan`, `planning.roofline`; built-in sizes are `StepSetup` fields); none by default."""
        return 0.0

    def step_meter(self, mesh: MeshContext, *, size: int) -> StepMeter | None:
        """What `planning.measure` records of it over a real step, for the estimate's run-time
        fields (ep: the busiest rank's routed load); None (nothing to measure) by default."""
        return None

    # ---- the composition -----------------------------------------------------------------
    #: Its place among the model-parallel phases applied to each model part before the
    #: data-parallel sharding (`registry.in_apply_order`: TP 10 -> CP 20 -> EP 30); None: it
    #: applies nothing per part (data parallelism is the strategy's, the pipeline splits around).
    apply_phase: ClassVar[int | None] = None

    def apply_to_stage(self, module: torch.nn.Module, *, build: StageBuild, size: int) -> None:
        """Apply it to one model part on the meta device (`size`: its size in the layout), leaving
        what the sharding needs in `build`; nothing by default."""
        return None

    def split_model(
        self, model: torch.nn.Module, *, split: ModelSplit, size: int
    ) -> tuple[list[torch.nn.Module], object] | None:
        """The parts of `model` this rank holds when it splits the model over its ranks (pp: the
        pipeline's stages), each through `split.build_part`, and what it resolved (its `Resolved`
        entry: the pipeline); None: it does not split (by default; the strategy asks each in
        registration order, the first that splits decides)."""
        return None

    def part_boundary(
        self, model: torch.nn.Module, *, mesh: MeshContext, section: DistributedSection, size: int
    ) -> BoundaryLayout | None:
        """The layout of the hidden states its regions leave between model parts, when they are not
        plain tensors (tp with sequence parallelism: ``Shard(1)`` over its axis): a part sends its
        local shard, the next rebuilds the DTensor with it. None by default; the first decides."""
        return None

    # ---- the training loop ---------------------------------------------------------------
    def shard_batch(self, batch: MicroBatch, *, run: BatchRun) -> MicroBatch:
        """This rank's share of one micro-batch (CP's sequence split); unchanged by default."""
        return batch

    def forward_rows(self, section: DistributedSection) -> int | None:
        """The rows one forward of the model takes when it runs the local batch itself in smaller
        pieces (pp: ``pipeline.pp_microbatch_size``), for the rules that need one row per forward
        (packed sequences, `recipe_config`); None: the loop's micro-batch, the local batch."""
        return None

    def runs_local_batch(self, model: LoopModel) -> bool:
        """Whether it runs a whole local batch itself (`run_local_batch`: the pipeline schedule
        runs every micro-batch's forward and backward) instead of the loop's micro-batches."""
        return False

    def run_local_batch(self, batch: MicroBatch, *, model: LoopModel, train: bool) -> torch.Tensor:
        """One local batch (already through every `shard_batch`, inside its context), forward and,
        when `train`, backward; the sum of its losses over this parallelism's group."""
        raise NotImplementedError(f"parallelism {self.name} does not run local batches")

    def finish_backward(self, model: LoopModel) -> None:
        """After the step's last backward, before the gradient norm (pp: the tied copies' sums)."""
        return None

    def norm_parameter_ids(self, model: LoopModel) -> set[int] | None:
        """The parameters (by id) the gradient norm counts when some are copies of others (pp: a
        tied weight two stages hold counts once); None: every one. The first that names some decides."""
        return None

    # ---- the layout report ---------------------------------------------------------------
    def describe_rank(self, resolved: Resolved) -> dict[str, object]:
        """What it resolved on this rank, as keys of the rank's report (cp: ``cp_backend``);
        nothing by default."""
        return {}

    def part_stage_ids(self, resolved: Resolved) -> list[int] | None:
        """The pipeline stage each of this rank's model parts is (pp), for the layout report;
        None: the parts are not stages."""
        return None

    def describe_part(self, part: torch.nn.Module) -> dict[str, object]:
        """What it put on one model part's modules that its parameters do not show (CP's attention
        hooks), read off the live part for the layout report; nothing by default."""
        return {}

    def report_lines(self, report: RankReport, *, axis_sizes: Mapping[str, int]) -> list[str]:
        """What this rank really holds of it, read off its report (not off the config): by
        default, per axis of `report_axes` larger than 1, how many parameters it shards."""
        params = report_parameters(report)
        lines = []
        for axis in self.report_axes:
            size = axis_sizes.get(axis, 1)
            sharded = [info for info in params if sharded_on(info, axis)]
            if size > 1 and sharded:
                lines.append(
                    f"[rank {report['rank']}] {axis} ({size} ranks): {len(sharded)}/{len(params)} parameters sharded"
                )
        return lines
