"""Per-rank peak memory of one training step, from the model's sizes and the layout alone.

The estimate follows what the step keeps alive, moment by moment (nothing is run or measured):

* static: sharded parameters and optimizer state (plus DDP's gradient buckets), all step long;
* forward end / loss backward: every saved activation of the rank's layers (one micro-batch, or
  the schedule's in-flight micro-batches under PP), the logits and the loss's fp32 buffers, and
  the parameters FSDP2 keeps unsharded (the root and the last layer; every layer under PP);
* each layer's backward, top to bottom: the saved activations of the layers below, this layer's
  activations (recomputed under activation checkpointing), its unsharded weights (and the next
  layer's, prefetched), its unsharded weight gradients and the gradients of the layers done;
* the optimizer step: parameters, gradients, state and the optimizer's temporaries.

The peak is the largest of these moments; `MemoryEstimate` reports its parts at that moment.
The parallelisms scale it through their hooks, multiplied over the registry: the share of the
layers, tokens, heads and experts each rank holds (`Parallelism.memory_shares`), the tensors they
add to a layer's saved activations (`layer_activation_terms`), the schedule positions whose peaks
are compared (`memory_positions`, the pipeline's first and last rank) and bytes held all step
(`memory_terms`); the data-parallel sharding is the strategy's (`StrategyMemory`).
Saved activations are counted tensor by tensor as Hugging Face decoder layers save them for
backward (RMSNorm keeps an fp32 copy of its input and its normalized output, attention keeps
q, k, v after RoPE, its output and log-sum-exp, the SwiGLU MLP keeps gate, up, silu(gate) and
their product); see docs/planning.md for the list and what the measurement counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from automodel.recipes.parallelisms import MemoryShares, RankPosition
from automodel.recipes.planning.shape import ModelShape
from automodel.recipes.planning.step import StepSetup as StepSetup
from automodel.recipes.planning.step import StrategyMemory as StrategyMemory
from automodel.recipes.planning.terms import (
    batch_ranks_of,
    expert_shard_ranks,
    layer_activation_terms,
    memory_positions,
    memory_shares,
    shard_ranks,
)

GiB = 2**30


@dataclass
class MemoryEstimate:
    """Per-rank bytes. `param_bytes`, `grad_bytes`, `optimizer_bytes` are the full steady amounts
    (all gradients present, as at the optimizer step); the ``peak_*`` parts add up to `peak_bytes`
    at the moment of the peak (`peak_phase`)."""

    total_params: int
    params_per_rank: float
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float = 0.0  # saved activations of one micro-batch, whole rank, by AC mode
    logits_bytes: float = 0.0  # logits and cross-entropy's buffers at their peak
    pipeline_bytes: float = 0.0  # saved activations of the other in-flight micro-batches
    buffer_bytes: float = 0.0  # unsharded FSDP weights/grads, DDP buckets, PP p2p buffers
    peak_bytes: float = 0.0
    peak_phase: str = ""
    peak_parts: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> float:
        return self.peak_bytes


def _chunked_loss_bytes(
    shape: ModelShape, s: StepSetup, *, shares: MemoryShares, tokens: float, e_c: int
) -> float:
    """Peak of the chunked linear cross-entropy (its gradients are computed in its forward): fp32
    gradients of the hidden states and of the head's rows this rank holds, plus one chunk's
    logits (see `automodel.recipes.linear_ce._chunked_pass` for what is in place)."""
    tied = shape.tied_embeddings
    v_local = shape.vocab / shares.heads if shares.heads > 1 and not tied else shape.vocab
    chunk = s.loss_chunk_tokens or max(
        16, 1 << int(math.log2(max(1, s.loss_chunk_elements // max(1, v_local))))
    )
    chunk = min(tokens, chunk)
    hidden = shape.hidden
    grads = 4 * (tokens * hidden + v_local * hidden)
    if e_c == 4:  # fp32: the logits are cast in place, the gradients are the fp32 buffers
        return grads + chunk * v_local * 4
    # below fp32: the chunk's product and its fp32 copy, then the gradient of its logits; the
    # head-gradient product per chunk, or at the end the gradients cast to the compute dtype
    chunk_bytes = chunk * v_local * (4 + e_c)
    casts = max(v_local * hidden * e_c, (tokens * hidden + v_local * hidden) * e_c)
    return grads + max(chunk_bytes + v_local * hidden * e_c, casts)


def _norm_bytes(setup: StepSetup, width: float) -> float:
    """RMSNorm saves an fp32 copy of its input (the input itself in fp32) and its output twice
    (x * rsqrt in fp32-or-compute dtype, then weight * that)."""
    return (4 + 2 * setup.compute_bytes) * width


def layer_activation_bytes(
    shape: ModelShape, setup: StepSetup, *, shares: MemoryShares, tokens: float, moe: bool
) -> float:
    """Bytes one decoder layer saves for backward for `tokens` tokens on this rank (no AC): the
    layer's own tensors at the rank's `shares`, plus each parallelism's terms where they add up
    (`Parallelism.layer_activation_terms`)."""
    e, heads = setup.compute_bytes, shares.heads
    terms = layer_activation_terms(setup, shape, shares=shares, moe=moe)
    h = shape.hidden
    h_norm = h / shares.norm_width if shares.norm_width > 1 else h
    per_token = 2 * _norm_bytes(setup, h_norm)
    for term in terms.get("norms", ()):
        per_token += term
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    # q and k after RoPE, v, attention output (compute dtype) and log-sum-exp per head (fp32)
    per_token += e * (2 * q + 2 * kv) / heads + 4 * shape.heads / heads
    for term in terms.get("attention", ()):
        per_token += term
    if moe:
        k, inter = shape.top_k, shape.moe_intermediate
        # router: fp32 logits and softmax per expert; per routed slot: the gathered input and the
        # weighted expert output where the token lives, gate|up, silu(gate) and their product where
        # its expert lives (the busiest owner computes `expert_load` times its share)
        load = shares.expert_load
        per_token += 2 * 4 * shape.experts + k * e * (2 * h + 4 * inter * load)
        for term in terms.get("experts", ()):
            per_token += term
        if shape.shared_intermediate:
            per_token += 4 * e * shape.shared_intermediate / heads
    else:
        per_token += 4 * e * shape.intermediate / heads
    return per_token * tokens


def _backward_transient(
    shape: ModelShape, setup: StepSetup, *, shares: MemoryShares, tokens: float, moe: bool
) -> float:
    """Gradients of activations alive inside one layer's backward (two MLP-wide, one hidden-wide)."""
    e = setup.compute_bytes
    if moe:
        load = shares.expert_load
        width = shape.top_k * (2 * shape.moe_intermediate + shape.hidden) * load
    else:
        width = 2 * shape.intermediate / shares.heads + shape.hidden
    return e * width * tokens


def estimate_step_memory(shape: ModelShape, setup: StepSetup) -> MemoryEstimate:
    """The per-rank peak of one step of `shape` under `setup` (the worst pipeline rank)."""
    estimates = [_estimate_rank(shape, setup, pos=pos) for pos in memory_positions(setup)]
    return max(estimates, key=lambda m: m.peak_bytes)


def _estimate_rank(shape: ModelShape, s: StepSetup, *, pos: RankPosition) -> MemoryEstimate:
    shares = memory_shares(s, shape)
    heads, e_s, e_c = shares.heads, s.storage_bytes, s.compute_bytes
    layers = shape.layers / shares.layers  # layers on this rank (all its stages)
    moe_frac = shape.moe_layers / shape.layers if shape.is_moe else 0.0
    first, last = pos.holds_embedding, pos.holds_head

    # ---- parameters: model-parallel split, then the data-parallel shard ----------------------
    expert_mp = shape.layer_expert_params / shares.experts
    layer_mp = shape.layer_dense_params / heads + expert_mp  # elements of one layer on this rank
    root_mp = (shape.embed_params if first or shape.tied_embeddings and last else 0) / heads
    root_mp += (shape.head_params if last else 0) / heads
    sh = s.sharding
    # the strategy's shard group; the experts a parallelism split off over theirs (ep_shard)
    fs_dense = shard_ranks(s, sh)
    fs_expert = (expert_shard_ranks(s) if sh.shard_over != "none" else None) or fs_dense
    layer_shard = shape.layer_dense_params / heads / fs_dense + expert_mp / fs_expert
    root_shard = root_mp / fs_dense
    unsharded = layers * layer_mp + root_mp  # the model-parallel part, not data-parallel sharded
    params_rank = layers * layer_shard + root_shard if sh.params_sharded else unsharded
    trainable_frac = 1.0 if s.trainable_params is None else s.trainable_params / max(shape.total_params, 1)
    opt_shard = layers * layer_shard + root_shard if sh.optimizer_sharded else unsharded
    grad_shard = opt_shard if sh.grads_sharded else unsharded
    grad_e = sh.grad_bytes or e_s
    param_b = params_rank * e_s
    grad_b = grad_shard * grad_e * trainable_frac
    opt_b = opt_shard * 4 * s.optimizer_states * trainable_frac
    if sh.fp32_master:
        opt_b += opt_shard * 4
    static = param_b + opt_b
    if sh.gradient_buckets and batch_ranks_of(s) > 1:
        static += grad_shard * e_s * trainable_frac  # flat gradient buckets, allocated once
    for _, extra in s.extra_bytes:  # other parallelisms' own terms (`StepSetup.extra_bytes`)
        static += extra

    # ---- activations of one micro-batch --------------------------------------------------------
    rows = pos.micro_batch_rows if pos.micro_batch_rows is not None else s.local_batch
    tokens = rows * s.seq_len / shares.tokens
    tokens_norm = tokens  # SP shards are inside the per-layer formula
    a_dense = layer_activation_bytes(shape, s, shares=shares, tokens=tokens, moe=False)
    a_moe = layer_activation_bytes(shape, s, shares=shares, tokens=tokens, moe=True) if moe_frac else 0.0
    a_layer = (1 - moe_frac) * a_dense + moe_frac * a_moe
    h_saved = shape.hidden / shares.norm_width if shares.norm_width > 1 else shape.hidden
    x_in = e_c * h_saved * tokens_norm  # what a checkpointed layer keeps: its input
    a_save = x_in if s.activation_checkpointing else a_layer
    a_peak_layer = max(a_dense, a_moe) if moe_frac else a_dense
    rope = 2 * shape.head_dim * e_c * tokens
    head_acts = _norm_bytes(s, h_saved) * tokens if last else 0.0
    extra_fp32 = 0 if e_c == 4 else 4
    # logits (compute dtype), their fp32 copy for the loss, log-softmax output, and in its
    # backward the gradient of the log-probabilities and of the logits
    logits_peak = tokens * shape.vocab * (e_c + extra_fp32 + 12) if last else 0.0
    logits_live = tokens * shape.vocab * e_c if last and not pos.scheduled else 0.0  # the loop's `logits`
    if s.loss_chunk_elements and last:
        logits_peak, logits_live = _chunked_loss_bytes(shape, s, shares=shares, tokens=tokens, e_c=e_c), 0.0
    transient = _backward_transient(shape, s, shares=shares, tokens=tokens, moe=bool(moe_frac))

    in_flight = pos.in_flight  # micro-batches of the whole rank's layers
    pipe_extra = (in_flight - 1) * layers * a_save

    # ---- buffers: unsharded weights / grads (FSDP2), p2p buffers (PP) ----------------------
    w_layer_u = layer_mp * e_c
    g_layer_u = layer_mp * e_c * trainable_frac
    g_layer_s = layer_shard * e_s * trainable_frac
    w_root_u = root_mp * e_c
    head_grad_u = (shape.head_params / heads if last else 0.0) * e_c * trainable_frac
    keep_all = pos.scheduled or s.reshard_after_forward is False
    if sh.gathered_weights == "layers":
        # layers reshard after forward except the last (none when keep_all); the root never
        held_fwd = (layers if keep_all else 1) * w_layer_u + w_root_u
        prefetch = w_layer_u
    elif sh.gathered_weights == "two_layers":
        held_fwd, prefetch = 2 * w_layer_u, w_layer_u
    else:
        held_fwd = prefetch = 0.0
        w_layer_u = 0.0
    # the previous layer's reduce-scatter input is still in flight while this layer's grads appear
    rs_in_flight = (
        layer_mp * s.reduce_bytes * trainable_frac if sh.reduce_scatter_in_flight and fs_dense > 1 else 0.0
    )
    p2p = 2 * e_c * shape.hidden * tokens * pos.p2p_stages if pos.p2p_stages else 0.0

    # ---- gradients held from earlier micro-batches of the step ----------------------------
    accum = s.grad_accum * pos.micro_batches
    unsharded_accum = sh.defer_unsharded_grads and not pos.scheduled and s.grad_accum > 1
    layers_int = max(1, round(layers))
    phases: dict[str, dict[str, float]] = {}

    def moment(name: str, **parts: float) -> None:
        phases[name] = {"static": static, **parts}

    for k_last in [False, True] if accum > 1 else [True]:
        if not k_last:
            held_g, new_g = 0.0, g_layer_s  # first micro-batch: gradients appear as layers finish
            if unsharded_accum:
                new_g = g_layer_u
        elif accum > 1 and unsharded_accum:
            held_g = layers * g_layer_u + (root_mp * e_c * trainable_frac)
            new_g = g_layer_s - g_layer_u  # the last reduce-scatter swaps unsharded for sharded
        elif accum > 1:
            held_g, new_g = grad_b, 0.0
        else:
            held_g, new_g = 0.0, g_layer_s
        tag = "last micro-batch" if k_last and accum > 1 else "first micro-batch" if accum > 1 else "step"
        moment(
            f"loss backward ({tag})",
            gradients=held_g,
            activations=layers * a_save + head_acts + rope,
            pipeline=pipe_extra,
            logits=logits_peak,
            buffers=held_fwd + p2p,
        )
        for i in range(layers_int - 1, -1, -1):
            done = layers_int - 1 - i
            current = a_peak_layer  # saved (or recomputed under AC) activations of this layer
            moment(
                f"layer {i} backward ({tag})",
                gradients=held_g + done * new_g + head_grad_u + g_layer_u + (rs_in_flight if done else 0.0),
                activations=i * a_save + current + rope + transient,
                pipeline=pipe_extra,
                logits=logits_live,
                buffers=w_root_u
                + p2p
                + (
                    held_fwd - w_root_u
                    if pos.scheduled
                    else (i + 1) * w_layer_u
                    if keep_all  # each layer reshards after its backward
                    else w_layer_u + (prefetch if i else 0.0)
                ),
            )
    if s.optimizer_impl == "fused":
        opt_tmp = 0.0
    elif s.optimizer_impl == "foreach":
        opt_tmp = opt_shard * 4 * trainable_frac  # one state-sized intermediate list
    else:
        opt_tmp = 2 * max(layer_shard / 3, root_shard) * 4 * trainable_frac
    moment("optimizer step", gradients=grad_b, buffers=opt_tmp)

    name, parts = max(phases.items(), key=lambda kv: sum(kv[1].values()))
    return MemoryEstimate(
        total_params=shape.total_params,
        params_per_rank=params_rank,
        param_bytes=param_b,
        grad_bytes=grad_b,
        optimizer_bytes=opt_b,
        activation_bytes=layers * a_save + head_acts + rope,
        logits_bytes=logits_peak,
        pipeline_bytes=pipe_extra,
        buffer_bytes=max(p.get("buffers", 0.0) for p in phases.values()),
        peak_bytes=sum(parts.values()),
        peak_phase=name,
        peak_parts={
            "parameters": param_b,
            "optimizer": opt_b,
            **dict(s.extra_bytes),
            **{k: v for k, v in parts.items() if k != "static"},
        },
    )
