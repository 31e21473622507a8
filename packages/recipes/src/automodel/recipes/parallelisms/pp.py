"""Pipeline parallelism (``distributed.pp_size``, options in ``distributed.pipeline`` ->
automodel.pipeline's `PipelineConfig`): the decoder layers split into stages run by a schedule."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from automodel.mesh import ResolvedLayout, StrategyConfig
from automodel.mesh.model_parts import text_config
from automodel.recipes.errors import ConfigError
from automodel.recipes.parallelisms.base import (
    LoopModel,
    MemoryShares,
    MetaModel,
    MicroBatch,
    ModelChecks,
    ModelSplit,
    Options,
    Parallelism,
    PlanColumn,
    RankPosition,
    RankReport,
    Resolved,
    SearchPoint,
    checked_once,
    config_error,
    section_mapping,
)
from automodel.recipes.parallelisms.registry import parallelisms
from automodel.recipes.parallelisms.tp import tensor_parallel_config

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from automodel.pipeline import BoundaryLayout, PipelineConfig, PipelineModel
    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.shape import ModelShape
    from automodel.recipes.planning.step import StepSetup, StepTraffic


def build_pipeline_config(pipeline: Options | None, *, local_batch_size: int) -> PipelineConfig:
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


def pipeline_stages(cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig) -> int:
    """Total pipeline stages for the configured schedule (validates the ``pipeline`` section); 1
    without pp (the model is one stage)."""
    pcfg = cfg.distributed.pipeline_config
    if pcfg is None:  # pp_size > 1 always has a pipeline config
        return 1
    # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
    from automodel.pipeline import num_stages_for

    if pcfg.module_fqns_per_model_part is not None:
        return len(pcfg.module_fqns_per_model_part)
    try:
        return num_stages_for(
            num_layers=text_config(hf_config).num_hidden_layers,
            pp_size=layout.pp,
            multi_stage=pcfg.schedule_spec.multi_stage,
            layers_per_stage=pcfg.layers_per_stage,
            round_to_pp_multiple=pcfg.round_virtual_stages_to_pp_multiple,
        )
    except ValueError as e:
        raise ConfigError("distributed.pp_size", layout.pp, str(e)) from None


#: Its `StepSetup` options (`StepSetup.option`): the micro-batch rows and the schedule.
MICROBATCH, SCHEDULE = "pp_microbatch", "pp_schedule"


def microbatch_of(setup: StepSetup) -> int:
    """Rows of one pipeline micro-batch in `setup` (1 unless the run or the search set it)."""
    return setup.option(MICROBATCH, 1)


def schedule_of(setup: StepSetup) -> str:
    """The pipeline schedule of `setup` (1F1B unless the run or the search set it)."""
    return setup.option(SCHEDULE, "1f1b")


def in_flight_chunks(setup: StepSetup, n_mb: int) -> int:
    """Stage-micro-batches whose activations the first pipeline rank holds at once."""
    name = schedule_of(setup).lower().replace("_", "")
    v, pp = setup.stages_per_rank, setup.pp
    if "gpipe" in name or "loopedbfs" in name:
        return n_mb * v
    if "zbv" in name or "dualpipe" in name:
        return min(n_mb * v, 2 * pp)
    if "interleaved" in name:  # torch's warm-up on rank 0, plus the one in flight
        return min(n_mb * v, (v - 1) * pp + 2 * (pp - 1) + 1)
    return min(n_mb, pp) * v  # 1F1B


class PipelineParallel(Parallelism["PipelineConfig"]):
    """Stages over pp ranks; one pipeline step takes one local batch in micro-batches."""

    name = "pp"
    size_key = "pp_size"
    section_key = "pipeline"
    holds_distinct_parameters = True
    search_order = 1
    plan_column = PlanColumn("pp (schedule)", 19, "<")

    def check_sizes(
        self, *, sizes: Mapping[str, int | None], data: Mapping[str, object], strategy_config: StrategyConfig
    ) -> None:
        pipeline = section_mapping(data, "pipeline")
        pp = sizes[self.size_key]
        if pp is not None and pp > 1 and pipeline is None:
            raise ConfigError("distributed.pp_size", pp, "pp_size > 1 needs a distributed.pipeline section")

    def config_class(self) -> type[PipelineConfig]:
        # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
        from automodel.pipeline import PipelineConfig

        return PipelineConfig

    def build_config(
        self, options: Options | None, *, size: int | None, local_batch_size: int
    ) -> PipelineConfig | None:
        if size == 1 and options is not None:
            warnings.warn("distributed.pipeline is ignored because pp_size == 1", stacklevel=3)
        if options is None or size == 1:
            return None
        return build_pipeline_config(options, local_batch_size=local_batch_size)

    def sequence_divisor(self, *, section: DistributedSection, layout: ResolvedLayout, size: int) -> int:
        """With sequence parallelism, a stage sends each tp rank's equal share of its cp share."""
        tp, cp = layout.axis_size("tp"), layout.axis_size("cp")
        sequence_parallel = tensor_parallel_config(section.parallelism_configs).sequence_parallel
        return cp * tp if size > 1 and tp > 1 and sequence_parallel else 1

    def check_model(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig, size: int
    ) -> None:
        if size == 1:
            return
        layers = text_config(hf_config).num_hidden_layers
        stages = pipeline_stages(cfg, layout, hf_config)
        pcfg = cfg.distributed.pipeline_config
        assert pcfg is not None
        if layers < stages:
            raise ConfigError(
                "distributed.pp_size",
                size,
                f"needs at least {stages} layers for {stages} pipeline stages, model has {layers}",
            )
        lb = cfg.step_scheduler.local_batch_size
        n_mb = lb // pcfg.pp_microbatch_size
        if n_mb < size:
            raise ConfigError(
                "step_scheduler.local_batch_size",
                lb,
                f"gives {n_mb} pipeline micro-batches (local_batch_size/pp_microbatch_size), fewer than pp_size={size}",
            )
        if pcfg.pp_schedule_csv is None:
            # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
            from automodel.pipeline.schedules import check_microbatch_count, resolve_schedule

            try:  # what the schedule itself needs of the count (per stage, equal rounds)
                check_microbatch_count(
                    spec=resolve_schedule(pcfg.pp_schedule),
                    pp_batch_size=lb,
                    pp_microbatch_size=pcfg.pp_microbatch_size,
                    num_stages=stages,
                    pp_size=size,
                )
            except ValueError as e:
                raise ConfigError(
                    "step_scheduler.local_batch_size", lb, f"(the pipeline's pp_batch_size): {e}"
                ) from None
        seq = cfg.seq_length
        multiple = self.sequence_divisor(section=cfg.distributed, layout=layout, size=size)
        if seq % multiple:
            raise ConfigError(
                cfg.seq_length_key,
                seq,
                f"must be divisible by cp_size*tp_size = {multiple} for sequence parallelism with pp_size > 1",
            )

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
        """The pipeline can split the model by structure (unless the YAML names each stage's modules)."""
        pcfg = cfg.distributed.pipeline_config
        if size == 1 or pcfg is None or pcfg.module_fqns_per_model_part is not None:
            return
        # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
        from automodel.pipeline import PipelineSplitError, validate_hf_model_for_pipeline_support

        error = checked_once(
            memo,
            ("pp",),
            lambda: validate_hf_model_for_pipeline_support(meta_model()),
            errors=PipelineSplitError,
        )
        if error is not None:
            raise self.cannot_apply(size, error)

    def check_files(self, *, cfg: RecipeConfig) -> None:
        pcfg = cfg.distributed.pipeline_config
        if pcfg is None or pcfg.pp_schedule_csv is None:
            return
        # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
        from automodel.pipeline.schedules import check_schedule_csv

        try:
            check_schedule_csv(pcfg.pp_schedule_csv)
        except ValueError as e:
            raise ConfigError("distributed.pipeline.pp_schedule_csv", pcfg.pp_schedule_csv, str(e)) from None

    def split_model(
        self, model: torch.nn.Module, *, split: ModelSplit, size: int
    ) -> tuple[list[torch.nn.Module], object] | None:
        """The stages this rank holds (automodel.pipeline's `AutoPipeline`), each through the
        strategy's per-part composition; the hidden states cross with the other parallelisms'
        `part_boundary` (tp's sequence-parallel shards)."""
        if size == 1:
            return None
        # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
        from automodel.pipeline import AutoPipeline

        def build_stage(module: torch.nn.Module, **_: object) -> None:
            split.build_part(module)

        pipe = AutoPipeline(mesh=split.mesh, config=split.section.pipeline_config, device=split.device).build(
            model,
            loss_fn=split.loss_fn,
            parallelize_fn=build_stage,
            boundary_layouts=_part_boundary(model, split=split),
        )
        return list(pipe.model_parts), pipe

    def pipeline(self, resolved: Resolved) -> PipelineModel | None:
        """The pipeline the strategy built (None without pp)."""
        return cast("PipelineModel | None", resolved.get(self.name))

    def forward_rows(self, section: DistributedSection) -> int | None:
        pipe = section.pipeline_config
        return None if pipe is None else pipe.pp_microbatch_size

    def runs_local_batch(self, model: LoopModel) -> bool:
        return self.pipeline(model.resolved) is not None

    def run_local_batch(self, batch: MicroBatch, *, model: LoopModel, train: bool) -> torch.Tensor:
        """The schedule runs every micro-batch's forward (and backward) itself; the loss (already
        over the step's tokens) summed over the pp group."""
        pipe = self.pipeline(model.resolved)
        assert pipe is not None
        fields = batch.fields
        args = {"labels": fields["labels"], "position_ids": fields["position_ids"], **batch.extra}
        ids = fields["input_ids"]
        loss = pipe.step(ids, **args) if train else pipe.eval(ids, **args)
        return pipe.reduce_loss(loss)

    def finish_backward(self, model: LoopModel) -> None:
        pipe = self.pipeline(model.resolved)
        if pipe is not None:  # tied embedding/head copies on the first and last stage
            pipe.sync_tied_gradients()

    def norm_parameter_ids(self, model: LoopModel) -> set[int] | None:
        """One copy of each tied weight (`PipelineModel.norm_parameters`)."""
        pipe = self.pipeline(model.resolved)
        return None if pipe is None else {id(p) for p in pipe.norm_parameters()}

    def part_stage_ids(self, resolved: Resolved) -> list[int] | None:
        pipe = self.pipeline(resolved)
        return None if pipe is None else list(pipe.stage_ids)

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        """At least two layers per stage."""
        pps = super().search_sizes(point)
        return [a for a in pps if a[self.name] == 1 or point.shape.layers >= 2 * a[self.name]]

    def validate_lines(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, size: int, stages: int, setup: StepSetup
    ) -> list[str]:
        pipe = cfg.distributed.pipeline_config
        if size == 1 or pipe is None:
            return []
        return [f"pipeline: {pipe.pp_schedule}, {stages} stages, micro-batch {pipe.pp_microbatch_size}"]

    def step_fields(self, *, section: DistributedSection, size: int, stages: int) -> dict[str, object]:
        fields: dict[str, object] = {"stages_per_rank": max(1, stages // size) if size > 1 else 1}
        pipe = section.pipeline_config
        if pipe is not None:
            fields.update({MICROBATCH: pipe.pp_microbatch_size, SCHEDULE: pipe.pp_schedule})
        return fields

    def search_options(self, *, size: int, shape: ModelShape) -> list[dict[str, object]]:
        """1F1B, and interleaved 1F1B with two stages per rank where the layers allow it."""
        if size == 1:
            return [{}]
        schedules = (("1f1b", 1), ("interleaved1f1b", 2))
        return [{SCHEDULE: s, "stages_per_rank": v} for s, v in schedules if shape.layers >= size * v]

    def search_local_batches(self, *, size: int) -> tuple[int, ...] | None:
        """Enough micro-batches (of one row) to fill the pipeline."""
        return (size, 2 * size, 4 * size) if size > 1 else None

    def plan_cell(self, setup: StepSetup) -> str:
        return f"{setup.pp}" if setup.pp == 1 else f"{setup.pp} {schedule_of(setup)}"

    def plan_yaml_section(self, setup: StepSetup) -> list[str]:
        if setup.pp == 1:
            return []
        return [
            "  pipeline:",
            f"    pp_schedule: {schedule_of(setup)}",
            f"    pp_microbatch_size: {microbatch_of(setup)}",
        ]

    def memory_shares(self, *, size: int, setup: StepSetup, shape: ModelShape) -> MemoryShares:
        """Each rank runs 1/pp of the decoder layers (its stages)."""
        return MemoryShares(layers=size)

    def memory_positions(self, *, size: int, setup: StepSetup) -> tuple[RankPosition, ...] | None:
        """The first rank (the embedding, the most micro-batches in flight) and the last (the
        head and the loss); V-shape schedules put the last stage on the first rank."""
        if size == 1:
            return None
        v = setup.stages_per_rank
        n_mb = max(1, setup.local_batch // microbatch_of(setup))
        v_shape = any(k in schedule_of(setup).lower() for k in ("zbv", "dualpipe"))
        common = {
            "scheduled": True,
            "micro_batch_rows": microbatch_of(setup),
            "micro_batches": n_mb,
            "in_flight": in_flight_chunks(setup, n_mb) / v,
            "p2p_stages": v,
        }
        first = RankPosition(holds_embedding=True, holds_head=v_shape, **common)
        last = RankPosition(holds_embedding=False, holds_head=not v_shape, **common)
        return (first, last)

    def bubble_s(self, *, compute_s: float, setup: StepSetup) -> float:
        """(pp - 1) of the stages' slots idle, over the stages per rank times the micro-batches."""
        s = setup
        n_mb = max(1, s.local_batch // microbatch_of(s))
        return compute_s * (s.pp - 1) / (s.stages_per_rank * n_mb) if s.pp > 1 else 0.0

    def exposed_comm_s(self, traffic: StepTraffic) -> float:
        """Activations and their gradients cross each stage boundary."""
        t, s = traffic, traffic.setup
        if s.pp == 1:
            return 0.0
        return 2 * t.micro_batches * t.mb_tokens * t.shape.hidden * s.compute_bytes / t.bandwidth(t.world)

    def report_lines(self, report: RankReport, *, axis_sizes: Mapping[str, int]) -> list[str]:
        parts = report["parts"]
        assert isinstance(parts, list)
        if not any("stage_ids" in part for part in parts):
            return []
        stages = [s for part in parts for s in part.get("stage_ids", [])]
        layers = [i for part in parts for i in part["layers"]]
        span = f"layers {min(layers)}-{max(layers)}" if layers else "no decoder layers"
        return [f"[rank {report['rank']}] pp ({axis_sizes.get('pp', 1)} ranks): stages {stages}, {span}"]


def _part_boundary(model: torch.nn.Module, *, split: ModelSplit) -> BoundaryLayout | None:
    """The first parallelism's layout of the hidden states between stages (`part_boundary`)."""
    layout = split.mesh.layout
    for p in parallelisms():
        found = p.part_boundary(
            model, mesh=split.mesh, section=split.section, size=p.size(split.section, layout)
        )
        if found is not None:
            return found
    return None
