"""The text `recipes plan` prints: the ranked table, the best layout's memory parts, its YAML."""

from __future__ import annotations

from automodel.recipes.planning.memory import GiB
from automodel.recipes.planning.search import Candidate


def _sched(c: Candidate) -> str:
    s = c.setup
    return f"{s.pp}" if s.pp == 1 else f"{s.pp} {s.pp_schedule}"


def format_table(cands: list[Candidate]) -> list[str]:
    head = (
        f"{'#':>2} {'tp':>3} {'pp (schedule)':<19} {'cp':>3} {'ep':>3} {'dp_shard':>8} {'dp_repl':>7} "
        f"{'AC':>4} {'lbs':>4} {'accum':>5} {'peak GiB':>9} {'step s':>8} {'tok/s/GPU':>10} {'MFU':>5}"
    )
    lines = [head, "-" * len(head)]
    for i, c in enumerate(cands, 1):
        s = c.setup
        lines.append(
            f"{i:>2} {s.tp:>3} {_sched(c):<19} {s.cp:>3} {s.ep:>3} {s.dp_shard:>8} {s.dp_replicate:>7} "
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
    lines = ["distributed:", "  strategy: fsdp2"]
    for key, value in (("tp_size", s.tp), ("pp_size", s.pp), ("cp_size", s.cp), ("ep_size", s.ep)):
        if value > 1:
            lines.append(f"  {key}: {value}")
    if s.dp_replicate > 1:
        lines.append(f"  dp_replicate_size: {s.dp_replicate}")
    if s.sequence_parallel:
        lines.append("  sequence_parallel: true")
    lines.append(f"  activation_checkpointing: {'true' if s.activation_checkpointing else 'false'}")
    lines.append(
        "  mp_policy: {_target_: torch.distributed.fsdp.MixedPrecisionPolicy, param_dtype: bfloat16, "
        "reduce_dtype: float32}"
    )
    if s.pp > 1:
        lines += [
            "  pipeline:",
            f"    pp_schedule: {s.pp_schedule}",
            f"    pp_microbatch_size: {s.pp_microbatch}",
        ]
    if s.ep > 1:
        lines += [f"  moe: {{reshard_after_forward: {'true' if s.reshard_after_forward else 'false'}}}"]
    lines.append(f"step_scheduler: {{global_batch_size: {global_batch}, local_batch_size: {s.local_batch}}}")
    return lines
