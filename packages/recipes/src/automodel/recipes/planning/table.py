"""The text `recipes plan` prints: the ranked table, the best layout's memory parts, its YAML."""

from __future__ import annotations

from automodel.recipes.parallelisms import Parallelism, PlanColumn, parallelisms, searched
from automodel.recipes.planning.memory import GiB
from automodel.recipes.planning.search import Candidate
from automodel.recipes.strategies.registry import planned_strategy


def _column(p: Parallelism) -> PlanColumn:
    return p.plan_column or PlanColumn(p.name, max(3, len(p.name)))


def format_table(cands: list[Candidate]) -> list[str]:
    """One row per candidate: the searched parallelisms' sizes (their columns, in search order),
    then the batch, the memory and time estimates."""
    columns = [(p, _column(p)) for p in searched()]
    sizes_head = "".join(f"{col.header:{col.align}{col.width}} " for _, col in columns)
    head = (
        f"{'#':>2} {sizes_head}"
        f"{'AC':>4} {'lbs':>4} {'accum':>5} {'peak GiB':>9} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>5}"
    )
    lines = [head, "-" * len(head)]
    for i, c in enumerate(cands, 1):
        s = c.setup
        sizes = "".join(f"{p.plan_cell(s):{col.align}{col.width}} " for p, col in columns)
        lines.append(
            f"{i:>2} {sizes}"
            f"{'full' if s.activation_checkpointing else 'none':>4} {s.local_batch:>4} {s.grad_accum:>5} "
            f"{c.memory.peak_bytes / GiB:>9.1f} {c.time.seconds:>8.2f} {c.tokens_per_s_per_gpu:>10,.0f} "
            f"{c.time.mfu:>5.0%}"
        )
    return lines


def format_memory(c: Candidate) -> list[str]:
    m = c.memory
    lines = [f"estimated per-rank peak {m.peak_bytes / GiB:.2f} GiB at {m.peak_phase}:"]
    for key, value in m.peak_parts.items():
        lines.append(f"  {key:<12}{value / GiB:>9.2f} GiB")
    t = c.time
    lines.append(
        f"estimated step {t.seconds:.2f} s: compute {t.compute_s:.2f} s + bubble {t.bubble_s:.2f} s, "
        f"FSDP traffic {t.fsdp_s:.2f} s (overlapped), exposed TP/CP/EP/PP/HSDP {t.exposed_comm_s:.2f} s"
    )
    return lines


def yaml_block(c: Candidate, *, global_batch: int) -> list[str]:
    s = c.setup
    used = [p.name for p in parallelisms() if p.in_use(s.size_of(p.name))]
    lines = ["distributed:", f"  strategy: {planned_strategy(used)}"]
    for p in searched():
        lines += p.plan_yaml(s)
    lines.append(f"  activation_checkpointing: {'true' if s.activation_checkpointing else 'false'}")
    lines.append(
        "  mp_policy: {_target_: torch.distributed.fsdp.MixedPrecisionPolicy, param_dtype: bfloat16, "
        "reduce_dtype: float32}"
    )
    for p in searched():
        lines += p.plan_yaml_section(s)
    lines.append(f"step_scheduler: {{global_batch_size: {global_batch}, local_batch_size: {s.local_batch}}}")
    return lines
