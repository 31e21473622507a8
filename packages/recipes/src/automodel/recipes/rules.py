"""Rules that tie the layout to the model, data and batch sizes (sizes alone are checked in mesh)."""

from __future__ import annotations

from typing import Any

from automodel.mesh import ResolvedLayout
from automodel.recipes.errors import ConfigError
from automodel.recipes.model import num_experts

#: Schedules that place more than one stage on each pp rank.
MULTI_STAGE_SCHEDULES = (
    "interleaved1f1b", "interleaved_1f1b", "loopedbfs", "looped_bfs", "interleavedzerobubble",
    "interleaved_zero_bubble", "zbvzerobubble", "zbv_zero_bubble", "zero_bubble", "dualpipev", "dual_pipe_v", "dfs",
    "v_schedule",
)  # fmt: skip


def stages_per_rank(pipeline: dict | None) -> int:
    if not pipeline:
        return 1
    explicit = pipeline.get("layers_per_stage") is None and pipeline.get("stages_per_rank")
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    name = str(pipeline.get("pp_schedule", "1f1b")).lower().replace("schedule", "")
    return 2 if name in MULTI_STAGE_SCHEDULES else 1


def check_layout_rules(cfg: Any, layout: ResolvedLayout, hf_config: Any) -> None:
    """Every divisibility rule of the issue: heads vs tp, layers vs stages, experts vs ep, seq vs cp, batch."""
    d = cfg.distributed
    tp, pp, cp, ep, dp = layout.tp, layout.pp, layout.cp, layout.ep, layout.dp
    heads = getattr(hf_config, "num_attention_heads", None)
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if tp > 1:
        if heads is not None and heads % tp:
            raise ConfigError("distributed.tp_size", tp, f"must divide model num_attention_heads={heads}")
        if kv is not None and kv % tp:
            raise ConfigError("distributed.tp_size", tp, f"must divide model num_key_value_heads={kv}")
        vocab = getattr(hf_config, "vocab_size", None)
        if vocab is not None and vocab % tp:
            raise ConfigError("distributed.tp_size", tp, f"must divide model vocab_size={vocab}")
    if pp > 1:
        layers = hf_config.num_hidden_layers
        stages = pp * stages_per_rank(d.pipeline)
        if layers < stages:
            raise ConfigError(
                "distributed.pp_size",
                pp,
                f"needs at least {stages} layers for {stages} pipeline stages, model has {layers}",
            )
        mb = d.pipeline.get("pp_microbatch_size", 1)
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ConfigError("distributed.pipeline.pp_microbatch_size", mb, "must be an int >= 1")
        lb = cfg.step_scheduler.local_batch_size
        if lb % mb:
            raise ConfigError(
                "step_scheduler.local_batch_size",
                lb,
                f"must be a multiple of distributed.pipeline.pp_microbatch_size={mb}",
            )
        n_mb = lb // mb
        if n_mb < pp:
            raise ConfigError(
                "step_scheduler.local_batch_size",
                lb,
                f"gives {n_mb} pipeline micro-batches (local_batch_size/pp_microbatch_size), fewer than pp_size={pp}",
            )
    if ep > 1:
        experts = num_experts(hf_config)
        if experts is None:
            raise ConfigError(
                "distributed.ep_size", ep, f"needs an MoE model; {hf_config.model_type} has no experts"
            )
        if experts % ep:
            raise ConfigError(
                "distributed.ep_size", ep, f"must divide the model's number of experts ({experts})"
            )
    if pp > 1 and cp > 1:
        raise ConfigError(
            "distributed.cp_size", cp, "context parallelism together with pp_size > 1 is not supported yet"
        )
    seq = cfg.seq_length
    if cp > 1 and seq % (2 * cp):
        key = (
            "packed_sequence.packed_sequence_size"
            if cfg.packed_sequence.packed_sequence_size
            else "dataset.seq_length"
        )
        raise ConfigError(
            key, seq, f"must be divisible by 2*cp_size = {2 * cp} (load-balanced context parallelism)"
        )
    ss = cfg.step_scheduler
    if ss.global_batch_size % (ss.local_batch_size * dp):
        raise ConfigError(
            "step_scheduler.global_batch_size",
            ss.global_batch_size,
            f"must be a multiple of local_batch_size*dp = {ss.local_batch_size}*{dp} = {ss.local_batch_size * dp}",
        )
