"""The planner's value types: a rank's step (`StepSetup`), what a strategy keeps (`StrategyMemory`),
the hardware (`Hardware`) and what a step moves (`StepTraffic`).

A leaf module (it imports no other recipes module): the parallelisms name these types in their
planner hooks, and the estimates (`planning.memory`, `planning.roofline`) fold those hooks over the
registry, so the value types live apart from both and no import circle forms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Literal, TypeVar

from automodel.mesh import flattened_axes, parallel_axes

if TYPE_CHECKING:
    from automodel.recipes.planning.shape import ModelShape

#: An option's type (`StepSetup.option`).
T = TypeVar("T")


#: Which ranks a data-parallel strategy shards its state over (`StrategyMemory.shard_over`).
ShardGroup = Literal["copies", "rows", "none"]


@dataclass(frozen=True)
class StrategyMemory:
    """What a data-parallel strategy keeps on each rank and moves between them, as the estimate and
    the roofline read it. Each strategy states its own (`Strategy.memory_model`); the defaults are
    FSDP2's, which `recipes plan` proposes."""

    #: The ranks parameters, gradients and optimizer state are sharded over, by role: ``copies``
    #: (inside each whole copy HSDP's replicas hold: FSDP2) or ``rows`` (every rank splitting the
    #: rows: megatron-fsdp), with the ranks holding parameter replicas (cp) each time, which is a
    #: flattened mesh axis of the table (`planning.terms.shard_axis_of`); or ``none`` (replicated:
    #: gradients are all-reduced). The experts a parallelism splits off may be sharded over ranks
    #: of their own (`Parallelism.expert_shard_ranks`).
    shard_over: ShardGroup = "copies"
    #: Which of the three are sharded (ZeRO stages: 3 shards all, 2 not the parameters, 1 only the
    #: optimizer state, 0 none).
    params_sharded: bool = True
    grads_sharded: bool = True
    optimizer_sharded: bool = True
    #: Bytes per gradient element (None: the storage dtype's).
    grad_bytes: int | None = None
    #: fp32 master weights kept beside the parameters.
    fp32_master: bool = False
    #: Flat gradient buckets allocated once, when more than one rank holds the model (DDP).
    gradient_buckets: bool = False
    #: Unsharded weights held during the step: ``layers`` (one FSDP unit per decoder layer, all but
    #: the last resharded after forward, every one under PP or with ``reshard_after_forward``
    #: false; the root unit stays unsharded; the next layer prefetched in backward), ``two_layers``
    #: (two layers' buckets plus one prefetched), or ``none``.
    gathered_weights: Literal["layers", "two_layers", "none"] = "layers"
    #: The previous layer's gradient reduce-scatter is still in flight while a layer's gradients appear.
    reduce_scatter_in_flight: bool = True
    #: Gradient accumulation keeps unsharded gradients until the last micro-batch (FSDP2's deferred sync).
    defer_unsharded_grads: bool = True


def sized(**sizes: int) -> tuple[tuple[str, int], ...]:
    """`StepSetup.sizes` from keyword sizes: ``StepSetup(sizes=sized(tp=2, dp_shard=4))``."""
    return tuple(sizes.items())


@dataclass(frozen=True)
class StepSetup:
    """The layout and training knobs of one rank's step.

    The sizes are keyed by name, not one field per axis: every mesh axis of the table
    (`automodel.mesh.parallel_axes`, a plugin's registered one included) and every registered
    parallelism that forms none; ``setup.tp`` reads the ``tp`` axis's size (1 when absent)."""

    #: Parallelism sizes by name (axis or parallelism); an absent one is 1. Kept sorted with the
    #: 1s dropped, so two setups of one layout compare equal.
    sizes: tuple[tuple[str, int], ...] = ()
    sharding: StrategyMemory = field(default_factory=StrategyMemory)
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    seq_len: int = 2048
    local_batch: int = 1  # rows of one local batch (one pipeline step under PP)
    grad_accum: int = 1  # local batches per optimizer step
    #: A parallelism's own options by name, read back by it with `option` (pp's micro-batch rows
    #: and schedule): set through `with_fields` from its `step_fields` / `search_options`. Kept
    #: sorted, so two setups of one run compare equal.
    options: tuple[tuple[str, object], ...] = ()
    stages_per_rank: int = 1
    storage_bytes: int = 4  # model.dtype: sharded parameters and their gradients
    compute_bytes: int = 4  # mp_policy.param_dtype: unsharded weights and activations
    reduce_bytes: int = 4
    optimizer_states: int = 2
    optimizer_impl: str = "foreach"  # foreach | fused | loop (per parameter)
    # FSDP2 units free their unsharded weights after forward: None = the recipes' default (all
    # layers but the last, none under PP); the MoE parallelizer takes distributed.moe's flag
    reshard_after_forward: bool | None = None
    trainable_params: int | None = None  # LoRA: only these have gradients and optimizer state
    # routed (token, expert) slots the busiest EP rank computes, over the balanced share: the
    # router decides it at run time (an untrained router gives ~1.4 on 2 ranks, measured)
    expert_load_factor: float = 1.0
    # the loss: full logits (0), or the chunked linear cross-entropy with this many fp32 logit
    # elements per chunk (`automodel.recipes.linear_ce.CHUNK_ELEMENTS`) or tokens per chunk
    loss_chunk_elements: int = 0
    loss_chunk_tokens: int | None = None
    # per-rank bytes held through the whole step by registered parallelisms beyond the built-in
    # axes' terms above, by name (`automodel.recipes.parallelisms.memory_terms`)
    extra_bytes: tuple[tuple[str, float], ...] = ()

    def option(self, name: str, default: T) -> T:
        """The option `name` a parallelism set (`options`), else `default`."""
        value = dict(self.options).get(name, default)
        assert isinstance(value, type(default)), (name, value)
        return value

    def with_fields(self, values: Mapping[str, object]) -> StepSetup:
        """This setup with `values` set: a field of the dataclass by its name, any other name as a
        parallelism's option (`option`)."""
        own = {f.name for f in fields(self)}
        options = dict(self.options) | {k: v for k, v in values.items() if k not in own}
        return replace(
            self,
            **{k: v for k, v in values.items() if k in own},
            options=tuple(sorted(options.items())),
        )

    def size_of(self, name: str) -> int:
        """The size of parallelism or mesh axis `name` (1: not used)."""
        return dict(self.sizes).get(name, 1)

    def __getattr__(self, name: str) -> int:
        """A mesh axis's size as an attribute (``setup.tp``), for every axis of the table: a
        flattened one's is the product of the axes it spans."""
        if not name.startswith("_"):
            if name in parallel_axes():
                return self.size_of(name)
            spans = flattened_axes().get(name)
            if spans is not None:
                return math.prod(self.size_of(a) for a in spans)
        raise AttributeError(f"StepSetup has no attribute {name!r}")

    def __post_init__(self) -> None:
        for name, size in self.sizes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be an int >= 1, got {size!r}")
        object.__setattr__(self, "sizes", tuple(sorted((n, v) for n, v in dict(self.sizes).items() if v > 1)))
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))
        for key in ("seq_len", "local_batch", "grad_accum"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an int >= 1, got {value!r}")
        if not self.expert_load_factor >= 1.0:
            raise ValueError(
                "expert_load_factor must be >= 1 (the busiest EP rank's routed slots over the mean), "
                f"got {self.expert_load_factor!r}"
            )


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links (defaults: H100 SXM, NVLink 4, one 400 Gb/s NDR port per GPU)."""

    memory_bytes: float = 80 * 2**30
    peak_flops: float = 989e12  # dense bf16
    efficiency: float = 0.5  # sustained fraction of peak for a transformer step
    nvlink_bytes_s: float = 450e9  # per direction, per GPU
    ib_bytes_s: float = 50e9  # per direction, per GPU
    gpus_per_node: int = 8
    memory_headroom: float = 0.9  # usable fraction: CUDA context, allocator fragmentation


def bandwidth(group_span: int, hw: Hardware) -> float:
    """Per-GPU bytes/s of a group spanning `group_span` ranks: NVLink inside a node, else IB."""
    return hw.nvlink_bytes_s if group_span <= hw.gpus_per_node else hw.ib_bytes_s


@dataclass(frozen=True)
class StepTraffic:
    """What one rank's step moves, shared by the parallelisms' exposed-communication terms
    (`Parallelism.exposed_comm_s`)."""

    setup: StepSetup
    shape: ModelShape
    hw: Hardware
    world: int
    #: The strategy shards parameters (else replicated, gradients all-reduced over dp).
    sharded: bool
    #: Ranks of the FSDP group (dp_shard x cp) and of the experts' FSDP group.
    fs: int
    efs: int
    #: Dense and expert parameters held per rank after the model-parallel split.
    dense_rank: float
    expert_rank: float
    #: Decoder layers on this rank, micro-batches per step, tokens per micro-batch on this rank.
    layers_rank: float
    micro_batches: int
    mb_tokens: float

    def bandwidth(self, group_span: int) -> float:
        """Per-GPU bytes/s of a group spanning `group_span` ranks (NVLink inside a node, else IB)."""
        return bandwidth(group_span, self.hw)
