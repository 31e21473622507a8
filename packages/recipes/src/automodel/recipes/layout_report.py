"""What this rank actually holds after the layout was applied, as plain JSON-able data.

The report is read off the live modules, not off the config (`automodel.mesh.layout_report`:
DTensor mesh axes, placements, global and local shapes and offsets of every parameter; FSDP2
units; the DDP wrapper and its reducer; activation-checkpointed modules), plus here the pipeline
stages of each part and megatron-fsdp's parameter buffers. `recipes train`
writes it to ``<output_dir>/layout/rank_<N>.json`` (``logging.layout_report``), so a user (and
the parity tests) can check that a strategy did what its name says.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from automodel.mesh import MeshContext
from automodel.mesh.layout_report import default_layers_fqn, describe_module, rank_report
from automodel.recipes.parallelisms import parallelisms
from automodel.recipes.parallelisms.base import Resolved
from automodel.recipes.parallelisms.base import is_shard_placement as is_shard_placement
from automodel.recipes.strategies.base import PLAIN_PARTS, PartWrapping

if TYPE_CHECKING:
    from automodel.recipes.strategies.base import Strategy


def layer_list_fqn(part: nn.Module) -> str | None:
    """FQN (as the model names it) of the part's list of decoder layers (``model.layers``,
    ``transformer.h``, ...), found the way the pipeline finds it; a pipeline stage's is the one
    its model was split by (its pruned list alone may not look like a whole model's)."""
    # lazy: start-up, automodel.pipeline (torch pipelining) ~1.7 s, only with pp
    from automodel.pipeline.hf_structure import HFStructure

    structure = getattr(part, "structure", None)
    if isinstance(structure, HFStructure):
        return structure.layers_fqn
    return default_layers_fqn(part)


def describe_part(
    part: nn.Module, *, stage_ids: list[int] | None = None, strategy: PartWrapping = PLAIN_PARTS
) -> dict[str, Any]:
    """One model part (the model, or one pipeline stage module) as this rank holds it
    (`automodel.mesh.layout_report.describe_module`, plus what the strategy's wrapper holds,
    `Strategy.describe_wrapper`, and what each parallelism applied, `Parallelism.describe_part`)."""
    report = describe_module(part, layers_fqn=layer_list_fqn(part), stage_ids=stage_ids)
    report.update(strategy.describe_wrapper(part))
    for parallelism in parallelisms():  # what each parallelism put on the modules (CP's attention)
        report.update(parallelism.describe_part(part))
    return report


def describe_rank(
    *, parts: list[nn.Module], mesh: MeshContext, strategy: Strategy, resolved: Resolved
) -> dict[str, Any]:
    """The whole report of this rank: layout coordinates plus every part it holds, and what each
    parallelism resolved (`Parallelism.describe_rank`, `Parallelism.part_stage_ids`)."""
    stage_ids = next((ids for p in parallelisms() if (ids := p.part_stage_ids(resolved)) is not None), None)
    per_part = [
        describe_part(part, stage_ids=None if stage_ids is None else [stage_ids[i]], strategy=strategy)
        for i, part in enumerate(parts)
    ]
    report = rank_report(parts=per_part, mesh=mesh, strategy=strategy.name)
    for parallelism in parallelisms():
        report.update(parallelism.describe_rank(resolved))
    return report


def write_rank_report(report: dict[str, Any], *, output_dir: Path) -> Path:
    """``<output_dir>/layout/rank_<N>.json``; each rank writes its own file."""
    path = Path(output_dir) / "layout" / f"rank_{report['rank']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    return path


def summary_lines(
    report: dict[str, Any], *, axis_sizes: dict[str, int], strategy: PartWrapping = PLAIN_PARTS
) -> list[str]:
    """One line per parallelism this rank really holds, read off its report (not off the config).

    Mesh axes count parameters whose placement shards on them; pipeline stages, FSDP units, the
    wrapper's (`Strategy.wrapper_lines`: the DDP reducer, megatron-fsdp's buffers) and checkpointed
    modules come from the parts themselves.
    """
    rank = report["rank"]
    parts = report["parts"]
    params = [info for part in parts for info in part["parameters"].values()]
    local = sum(math.prod(info["local_shape"]) for info in params)
    lines = [
        f"[rank {rank}] {report['strategy']}: holds {len(params)} parameter tensors ({local:,} elements)"
    ]
    for parallelism in parallelisms():  # each registered parallelism's own line(s)
        lines += parallelism.report_lines(report, axis_sizes=axis_sizes)
    units = sum(len(part["fsdp_units"]) for part in parts)
    if units:
        lines.append(f"[rank {rank}] fsdp2: {units} units")
    lines += [line for part in parts for line in strategy.wrapper_lines(part, rank=rank)]
    checkpointed = sum(len(part["checkpointed"]) for part in parts)
    if checkpointed:
        lines.append(f"[rank {rank}] activation checkpointing: {checkpointed} modules")
    return lines
