"""The one table of parallel layouts every package's parity tests run (a testing module).

Each `Layout` is a named ``distributed`` section (the recipes' YAML keys: ``tp_size``,
``pp_size``, ``cp_size``, ``ep_size``, ``dp_replicate_size``, ``strategy``, ``sequence_parallel``,
``activation_checkpointing``, ``pipeline``, ``tp_plan``) on a number of ranks, for one tiny model
(`automodel.testing.tiny_model`). The recipes' parity matrix runs the layouts marked ``in_matrix``
end to end; a package runs the ones it composes alone, picked by a documented filter in its tests
(automodel-fsdp2: no pipeline, CP or EP; automodel-moe-ep: the MoE model with only ep and data
parallelism), never a copy. A layout only one suite runs is still listed here, with
``in_matrix=False``, so the names and sections stay one. `layouts_named` picks by name.

An entry also states what the checker (`automodel.testing.layout_check.check_layout_applied`)
cannot read off the sizes: ``replicated`` says its data parallelism copies the parameters (DDP)
rather than shards them, so the checker never compares strategy names. The axes and their YAML
size keys come from `automodel.mesh.axes`, so an axis added there is sized here too.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from automodel.mesh import ParallelismSizes, axes

#: The axes a ``distributed`` section sizes, by their YAML keys (`axes()`' parallel, sized rows: pp,
#: dp_replicate, cp, tp, ep).
_SIZE_KEYS: dict[str, str] = {a.name: a.size_key for a in axes() if a.parallel and a.size_key is not None}


@dataclass(frozen=True)
class Layout:
    """A named ``distributed`` section on `ranks` ranks, for the tiny `model` ("dense": Llama,
    "moe": Qwen3-MoE, or another tiny model_type such as "qwen3"); `extra` overrides other
    sections (merged into them); `in_matrix`: run by the recipes' parity matrix; `replicated`: its
    data parallelism keeps a whole copy of every parameter on each rank and all-reduces gradients
    (DDP) instead of sharding them (FSDP), which is what the checker asserts."""

    name: str
    ranks: int
    distributed: dict[str, Any]
    model: str = "dense"
    extra: dict[str, Any] = field(default_factory=dict)
    in_matrix: bool = True
    replicated: bool = False

    def size(self, key: str) -> int:
        """The section's `key` (``tp_size``, ...), 1 when unset."""
        return int(self.distributed.get(key) or 1)

    def axis_size(self, axis: str) -> int:
        """The size of sized mesh `axis` (``tp``, ...; see `axes`), 1 when unset (KeyError: not sized)."""
        return self.size(_SIZE_KEYS[axis])

    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicate x shard): what the sizes leave of `ranks`."""
        return self.ranks // (self.axis_size("tp") * self.axis_size("pp") * self.axis_size("cp"))

    @property
    def sequence_parallel(self) -> bool:
        """TP also shards the norms' activations over the sequence (the norms live on the tp mesh)."""
        return bool(self.distributed.get("sequence_parallel"))

    @property
    def activation_checkpointing(self) -> bool:
        """Every decoder layer is activation-checkpointed."""
        return bool(self.distributed.get("activation_checkpointing"))

    @property
    def axes(self) -> frozenset[str]:
        """The sized axes this layout splits over (of pp, dp_replicate, cp, tp, ep)."""
        return frozenset(axis for axis, key in _SIZE_KEYS.items() if self.size(key) > 1)

    def sizes(self) -> ParallelismSizes:
        """The section's sizes as `ParallelismSizes` (the package tests build their mesh from it)."""
        sizes: dict[str, int | None] = {key: self.size(key) for key in _SIZE_KEYS.values()}
        replicate = self.distributed.get("dp_replicate_size")
        sizes["dp_replicate_size"] = int(replicate) if replicate else None  # unset: derived, not 1
        return ParallelismSizes(**sizes)


def _pp(schedule: str) -> dict[str, Any]:
    return {"pp_size": 2, "pipeline": {"pp_schedule": schedule, "pp_microbatch_size": 1}}


#: Llama's own plan written out, with the embedding split by vocabulary rows and the head gathered.
EXPLICIT_TP_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    **{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}

PP_SCHEDULES = ("1f1b", "gpipe", "interleaved1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev")
_AC = {"activation_checkpointing": True}
_TP2_SP = {"tp_size": 2, "sequence_parallel": True}

LAYOUTS: list[Layout] = [
    Layout("ddp2", 2, {"strategy": "ddp"}, replicated=True),
    Layout("fsdp2_dp2", 2, {}),
    Layout("fsdp2_dp4", 4, {}),
    Layout("hsdp_2x2", 4, {"dp_replicate_size": 2}),
    Layout("tp2", 2, {"tp_size": 2}),
    Layout("tp2_sp", 2, dict(_TP2_SP)),
    Layout("fsdp2xtp_2x2", 4, {"tp_size": 2}),
    *[Layout(f"pp2_{s}", 2, _pp(s)) for s in PP_SCHEDULES if s != "dualpipev"],
    # DualPipeV needs at least as many micro-batches as its 4 stages: 4 rows of 1 per micro-step.
    Layout("pp2_dualpipev", 2, _pp("dualpipev"), extra={"step_scheduler": {"local_batch_size": 4}}),
    Layout("pp2xfsdp2", 4, _pp("1f1b")),
    Layout("pp2xtp2", 4, {**_pp("1f1b"), "tp_size": 2}),
    # a user's explicit plan naming modules only the last stage holds (lm_head, the final norm)
    Layout("pp2xtp2_plan", 4, {**_pp("1f1b"), "tp_size": 2, "tp_plan": EXPLICIT_TP_PLAN}),
    # the sequence-sharded residual stream crosses the stages as local shards, rebuilt as DTensors
    Layout("pp2xtp2_sp", 4, {**_pp("1f1b"), **_TP2_SP}),
    Layout("cp2", 2, {"cp_size": 2}),
    Layout("cp2xfsdp2", 4, {"cp_size": 2}),
    # each stage's attention is context parallel; the schedule runs inside the CP context
    Layout("pp2xcp2", 4, {**_pp("1f1b"), "cp_size": 2}),
    Layout("ep2", 2, {"ep_size": 2}, model="moe"),
    Layout("ep2xfsdp2", 4, {"ep_size": 2}, model="moe"),
    # TP shards attention of the MoE model; experts are replicated over tp (EP shards them).
    Layout("tp2_moe", 2, {"tp_size": 2}, model="moe"),
    Layout("ep2xtp2", 4, {"ep_size": 2, "tp_size": 2}, model="moe"),
    # each stage's experts split over the ep ranks of its dp group (the stage's FSDP units first
    # probe the experts on a later stage's placeholder hidden states)
    Layout("pp2xep2", 4, {**_pp("1f1b"), "ep_size": 2}, model="moe"),
    Layout("pp2xtp2xdp2", 8, {**_pp("1f1b"), "tp_size": 2}),
    # ---- not in the parity matrix: run by one suite each -------------------------------------
    # activation checkpointing under each data-parallel strategy and under TP + SP (fsdp2, recipes)
    Layout("fsdp2_dp2_ac", 2, dict(_AC), in_matrix=False),
    Layout("ddp2_ac", 2, {"strategy": "ddp", **_AC}, in_matrix=False, replicated=True),
    Layout("fsdp2xtp2_sp_ac", 4, {**_TP2_SP, **_AC}, in_matrix=False),
    # SP on a model with q/k norms inside attention (fsdp2)
    Layout("fsdp2xtp2_sp_qwen3", 4, dict(_TP2_SP), model="qwen3", in_matrix=False),
    # every rank its own 2 of 8 experts, nothing left for FSDP to shard them over (moe-ep)
    Layout("ep4", 4, {"ep_size": 4}, model="moe", in_matrix=False),
    # the pipeline's other data-parallel schedule (recipes)
    Layout("pp2xfsdp2_gpipe", 4, _pp("gpipe"), in_matrix=False),
    # two stages per rank with checkpointing inside them; EP beside CP; a stage of dense layers
    # only (the conformance sweep's composed cases)
    Layout("pp2_ac", 2, {**_pp("interleaved1f1b"), **_AC}, in_matrix=False),
    Layout("ep2xcp2", 4, {"ep_size": 2, "cp_size": 2}, model="moe", in_matrix=False),
    Layout("pp2xep2_ac", 4, {**_pp("interleaved1f1b"), "ep_size": 2, **_AC}, model="moe", in_matrix=False),
]

#: The layouts the recipes' parity matrix runs end to end (docs/parity.md).
MATRIX_LAYOUTS: list[Layout] = [layout for layout in LAYOUTS if layout.in_matrix]


def layouts_named(*names: str) -> list[Layout]:
    """The `LAYOUTS` entries of `names`, in that order (copies; KeyError naming an unknown one)."""
    by_name = {layout.name: layout for layout in LAYOUTS}
    return [copy.deepcopy(by_name[name]) for name in names]
