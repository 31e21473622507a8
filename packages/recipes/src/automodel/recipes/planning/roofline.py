"""Step time from a roofline: matmul FLOPs at a sustained fraction of peak, the pipeline bubble,
and the bytes each mesh axis moves over NVLink (inside a node) or InfiniBand (across nodes).

FSDP's gathers and reduce-scatters overlap compute (the step takes the longer of the two); TP,
CP and EP collectives sit on the critical path and add; HSDP's all-reduce adds what compute
cannot hide. Each parallelism's exposed term is its `Parallelism.exposed_comm_s` over the step's
`StepTraffic`. These are the rules the table ranks by; docs/planning.md lists the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from automodel.mesh import dense_axes, flattened_axes
from automodel.recipes.parallelisms import parallelisms
from automodel.recipes.planning.shape import ModelShape
from automodel.recipes.planning.step import Hardware as Hardware
from automodel.recipes.planning.step import StepSetup, StepTraffic, bandwidth
from automodel.recipes.planning.terms import (
    batch_ranks_of,
    expert_shard_ranks,
    memory_positions,
    memory_shares,
    shard_axis_of,
    shard_ranks,
)


@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute_s: float
    bubble_s: float
    fsdp_s: float
    exposed_comm_s: float
    tokens: float
    mfu: float


def _routed_params_per_token(shape: ModelShape) -> float:
    """Expert matmul parameters one token passes through in one layer (its top-k experts)."""
    return shape.layer_expert_params * shape.top_k / shape.experts if shape.is_moe else 0.0


def training_flops_per_token(shape: ModelShape, seq_len: int, *, recompute: bool) -> float:
    """6 x active matmul parameters + causal attention scores, x 4/3 with layer recompute (AC)."""
    layer = shape.layer_dense_params + _routed_params_per_token(shape)
    attn = 6 * seq_len * shape.heads * shape.head_dim  # QK^T and AV, causal half, fwd + bwd
    head = 6 * shape.vocab * shape.hidden
    per_layer = 6 * layer + attn
    if recompute:
        per_layer *= 4 / 3
    return shape.layers * per_layer + head


def estimate_step_time(shape: ModelShape, s: StepSetup, hw: Hardware, *, world: int) -> StepTime:
    """Seconds of one optimizer step of `s` on `world` GPUs."""
    # the parallelisms' shares of the model and the tokens, and the schedule's micro-batches
    # (`Parallelism.memory_shares`, `memory_positions`): pp's layers, cp's tokens, tp's and ep's
    # weights, pp's micro-batches, each through its own hook
    shares = memory_shares(s, shape)
    position = memory_positions(s)[0]
    rows = s.local_batch * s.grad_accum * batch_ranks_of(s)
    tokens = rows * s.seq_len
    flops = tokens * training_flops_per_token(shape, s.seq_len, recompute=s.activation_checkpointing)
    # the busiest EP rank computes expert_load times its share of the routed slots
    routed = 6 * shape.layers * _routed_params_per_token(shape) * (4 / 3 if s.activation_checkpointing else 1)
    flops += (shares.expert_load - 1) * tokens * routed
    compute = flops / world / (hw.peak_flops * hw.efficiency)
    bubble = 0.0
    for parallelism in parallelisms():  # the idle time of a schedule over ranks (pp's bubble)
        bubble += parallelism.bubble_s(compute_s=compute, setup=s)
    e = s.compute_bytes
    layers_rank = shape.layers / shares.layers
    mb_rows = s.local_batch if position.micro_batch_rows is None else position.micro_batch_rows
    mb_tokens = mb_rows * s.seq_len / shares.tokens
    micro_batches = s.grad_accum * position.micro_batches
    # FSDP over its shard group (`StrategyMemory.shard_over`): gather bf16 weights for forward and
    # backward of every micro-batch, reduce-scatter the gradients once per step (reduce dtype)
    fs = shard_ranks(s, s.sharding)
    dense_rank = (shape.layer_dense_params / shares.heads * layers_rank) + (
        shape.embed_params + shape.head_params
    ) / shares.heads / shares.layers
    expert_rank = shape.layer_expert_params / shares.experts * layers_rank
    sharded = s.sharding.shard_over != "none"  # else replicated: gradients all-reduced over dp
    fsdp = 0.0
    if sharded and fs > 1:
        # the FSDP group spans its outermost dense axis and the dense axes inside it
        dense = dense_axes()
        spanned = shard_axis_of(s.sharding)
        assert spanned is not None  # sharded
        outermost = flattened_axes()[spanned][0]
        bw = bandwidth(math.prod(s.size_of(a) for a in dense[dense.index(outermost) :]), hw)
        # without PP a layer is gathered for forward and again for backward, unless it stays
        # gathered in between (moe.reshard_after_forward: false)
        per_micro_batch = 1 if s.reshard_after_forward is False else 2
        # a schedule (pp) keeps every layer gathered over its micro-batches
        gathers = 2 * s.grad_accum if position.scheduled else per_micro_batch * micro_batches
        fsdp += (fs - 1) / fs * dense_rank * (gathers * e + s.reduce_bytes) / bw
    efs = expert_shard_ranks(s) or fs  # the experts a parallelism split off (ep), over their ranks
    if sharded and efs > 1 and expert_rank:
        expert_gathers = (1 if s.reshard_after_forward is False else 2) * micro_batches
        fsdp += (efs - 1) / efs * expert_rank * (expert_gathers * e + s.reduce_bytes) / bandwidth(world, hw)
    traffic = StepTraffic(
        setup=s,
        shape=shape,
        hw=hw,
        world=world,
        sharded=sharded,
        fs=fs,
        efs=efs,
        dense_rank=dense_rank,
        expert_rank=expert_rank,
        layers_rank=layers_rank,
        micro_batches=micro_batches,
        mb_tokens=mb_tokens,
    )
    exposed = 0.0
    for parallelism in parallelisms():  # collectives on the critical path, in registration order
        exposed += parallelism.exposed_comm_s(traffic)
    seconds = max(compute + bubble, fsdp) + exposed
    model_flops = tokens * training_flops_per_token(shape, s.seq_len, recompute=False)
    mfu = model_flops / (seconds * world * hw.peak_flops)
    return StepTime(
        seconds=seconds,
        compute_s=compute,
        bubble_s=bubble,
        fsdp_s=fsdp,
        exposed_comm_s=exposed,
        tokens=tokens,
        mfu=mfu,
    )
