"""Context parallelism (``distributed.cp_size``): each rank holds a load-balanced share of every
sequence; attention exchanges K/V across the cp ranks (automodel.context_parallel)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from automodel.mesh import ResolvedLayout
from automodel.recipes.errors import ConfigError
from automodel.recipes.parallelisms.base import Parallelism, RankReport

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from automodel.recipes.recipe_config import RecipeConfig


class ContextParallel(Parallelism):
    """The sequence split in 2*cp chunks, rank i holding chunks i and 2*cp-1-i."""

    name = "cp"
    size_key = "cp_size"
    report_axes = ("cp",)

    def check_model(
        self, *, cfg: RecipeConfig, layout: ResolvedLayout, hf_config: PretrainedConfig, size: int
    ) -> None:
        seq = cfg.seq_length
        if size > 1 and seq % (2 * size):
            raise ConfigError(
                cfg.seq_length_key,
                seq,
                f"must be divisible by 2*cp_size = {2 * size} (load-balanced context parallelism)",
            )

    def report_lines(self, report: RankReport, *, axis_sizes: Mapping[str, int]) -> list[str]:
        lines = super().report_lines(report, axis_sizes=axis_sizes)
        backend = report.get("cp_backend", "none")
        if backend != "none":
            lines.append(
                f"[rank {report['rank']}] cp ({axis_sizes.get('cp', 1)} ranks): attention backend {backend}"
            )
        return lines
