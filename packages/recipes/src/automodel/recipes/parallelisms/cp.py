"""Context parallelism (``distributed.cp_size``): each rank holds a load-balanced share of every
sequence; attention exchanges K/V across the cp ranks (automodel.context_parallel)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from automodel.context_parallel import (
    apply_context_parallel,
    check_context_parallel_support,
    context_parallel_modules,
    make_cp_batch_and_ctx,
)
from automodel.mesh import ResolvedLayout
from automodel.recipes.errors import ConfigError
from automodel.recipes.parallelisms.base import (
    ActivationSite,
    BatchContext,
    BatchRun,
    MemoryShares,
    MetaModel,
    MicroBatch,
    ModelChecks,
    Parallelism,
    PlanColumn,
    RankReport,
    Resolved,
    SearchPoint,
    StageBuild,
    checked_once,
    divisors,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.recipes.config.distributed import DistributedSection
    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.planning.shape import ModelShape
    from automodel.recipes.planning.step import StepSetup, StepTraffic


def document_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative document boundaries of one packed row (positions restart at 0 per document)."""
    assert position_ids.shape[0] == 1, "packed rows come one per micro-batch"
    starts = torch.nonzero(position_ids[0] == 0).flatten()
    end = torch.tensor([position_ids.shape[1]], device=position_ids.device)
    return torch.cat([starts, end]).to(torch.int32)


def context_parallel_inputs(
    fields: dict[str, torch.Tensor],
    *,
    cp_mesh: DeviceMesh,
    backend: str,
    pad_token_id: int,
    packed: bool,
) -> tuple[BatchContext, dict[str, torch.Tensor], dict[str, object]]:
    """This CP rank's share of one micro-batch: ``(context, fields, extra model kwargs)``.

    The sequence is padded to a multiple of 2 * cp with the tokenizer's pad token (labels -100);
    packed rows carry their document boundaries so attention stays inside each document.
    """
    fields = dict(fields)
    if packed:
        fields["cu_seqlens"] = document_cu_seqlens(fields["position_ids"])
    ctx, local = make_cp_batch_and_ctx(cp_mesh, fields, backend=backend, padding_token_id=pad_token_id)
    extra: dict[str, object] = {
        k: local[k] for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen") if k in local
    }
    return ctx, local, extra


class ContextParallel(Parallelism[None]):
    """The sequence split in 2*cp chunks, rank i holding chunks i and 2*cp-1-i."""

    name = "cp"
    size_key = "cp_size"
    report_axes = ("cp",)
    splits_tokens = True
    apply_phase = 20
    search_order = 2
    plan_column = PlanColumn("cp", 3)

    #: The largest cp `recipes plan` tries.
    max_searched = 8

    def sequence_divisor(self, *, section: DistributedSection, layout: ResolvedLayout, size: int) -> int:
        """2 * cp chunks of equal length (load-balanced: rank i holds chunks i and 2*cp-1-i)."""
        return 2 * size if size > 1 else 1

    def check_model(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig, size: int
    ) -> None:
        seq = cfg.seq_length
        multiple = self.sequence_divisor(section=cfg.distributed, layout=layout, size=size)
        if seq % multiple:
            raise ConfigError(
                cfg.seq_length_key,
                seq,
                f"must be divisible by 2*cp_size = {multiple} (load-balanced context parallelism)",
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
        """The model's attention can run context-parallel (automodel.context_parallel's rule)."""
        if size == 1:
            return
        seq = cfg.seq_length
        error = checked_once(
            memo, ("cp", seq), lambda: check_context_parallel_support(meta_model(), seq_length=seq)
        )
        if error is not None:
            raise self.cannot_apply(size, error)

    def apply_to_stage(self, module: torch.nn.Module, *, build: StageBuild, size: int) -> None:
        """Attention context parallel over ``cp`` (its backend: what `shard_batch` runs with)."""
        if size > 1:
            build.resolved[self.name] = apply_context_parallel(module, cp_mesh=build.mesh.get_mesh("cp"))

    def backend(self, resolved: Resolved) -> str:
        """The attention backend it was applied with ("none": not applied)."""
        return str(resolved.get(self.name, "none"))

    def shard_batch(self, batch: MicroBatch, *, run: BatchRun) -> MicroBatch:
        """The load-balanced sequence share of this cp rank, and the context ring attention runs in."""
        backend = self.backend(run.resolved)
        if backend == "none":
            return batch
        assert not batch.extra, "context parallelism shards the batch first"
        ctx, fields, extra = context_parallel_inputs(
            batch.fields,
            cp_mesh=run.mesh.get_mesh("cp"),
            backend=backend,
            pad_token_id=run.pad_token_id,
            packed=run.packed,
        )
        return MicroBatch(fields=fields, extra=extra, context=ctx)

    def search_sizes(self, point: SearchPoint) -> list[dict[str, int]]:
        return [{self.name: c} for c in divisors(point.room) if c <= self.max_searched]

    def memory_shares(self, *, size: int, setup: StepSetup, shape: ModelShape) -> MemoryShares:
        """Each rank holds 1/cp of every sequence's tokens."""
        return MemoryShares(tokens=size)

    def layer_activation_terms(
        self, *, size: int, setup: StepSetup, shape: ModelShape, shares: MemoryShares, moe: bool
    ) -> dict[ActivationSite, float]:
        """The ring keeps the other ranks' k and v for backward."""
        if size == 1:
            return {}
        kv = shape.kv_heads * shape.head_dim
        return {"attention": setup.compute_bytes * 2 * kv / shares.heads * (size - 1)}

    def exposed_comm_s(self, traffic: StepTraffic) -> float:
        """Every rank's k/v chunk visits the others, forward and backward."""
        t, s, shape = traffic, traffic.setup, traffic.shape
        if s.cp == 1:
            return 0.0
        kv = 2 * shape.kv_heads * shape.head_dim * t.mb_tokens * s.compute_bytes / s.tp
        return 2 * t.layers_rank * t.micro_batches * (s.cp - 1) * kv / t.bandwidth(s.cp * s.tp)

    def describe_rank(self, resolved: Resolved) -> dict[str, object]:
        """``cp_backend``: the attention backend ("none" without CP)."""
        return {"cp_backend": self.backend(resolved)}

    def describe_part(self, part: torch.nn.Module) -> dict[str, object]:
        """The attention modules that carry the CP group and hooks (`cp_attention`)."""
        return {"cp_attention": context_parallel_modules(part)}

    def report_lines(self, report: RankReport, *, axis_sizes: Mapping[str, int]) -> list[str]:
        lines = super().report_lines(report, axis_sizes=axis_sizes)
        backend = report.get("cp_backend", "none")
        if backend != "none":
            lines.append(
                f"[rank {report['rank']}] cp ({axis_sizes.get('cp', 1)} ranks): attention backend {backend}"
            )
        return lines
