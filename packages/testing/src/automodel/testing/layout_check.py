"""Did a layout really apply? One checker for every package's parity tests (a testing module).

Parity alone cannot tell a layout from one process: a run with the parallelism silently off
reproduces the reference losses too. `check_layout_applied` reads what every rank really holds
(`automodel.mesh.layout_report`: written by `recipes train` to ``layout/rank_<N>.json``, or built
by a package test from its live model) and fails unless each parallelism of the layout was applied:
FSDP shards on dim 0 over ``dp_shard_cp``, HSDP replicates over ``dp_replicate``, TP shards
attention and MLP per the plan, SP puts the norms on the tp mesh, pipeline stages hold disjoint
layers, experts are split over ``ep``, a replicated layout (DDP) wraps the whole model with a
gradient reducer, CP runs the ring backend with every attention module hooked, activation checkpointing wraps every decoder layer.

It is strategy-blind: it reads a `Layout` entry (`automodel.testing.layout_table`) - the axis
sizes and the entry's own facts such as ``replicated`` - never a strategy name or YAML key.

By default it knows the tiny models' parameter names (`automodel.testing.tiny_model`) and checks
each placement exactly; with ``any_architecture`` it checks the same idea generically over model
families (the conformance sweep), the decoder layers found from each report's ``layers_fqn``.
The layouts themselves: `automodel.testing.layout_table`.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from automodel.mesh import dense_axes, flattened_axes
from automodel.testing.layout_table import Layout

#: One rank's report (`automodel.mesh.layout_report.rank_report`), as JSON-able data.
Report = dict[str, Any]

Q_PROJ = "model.layers.{i}.self_attn.q_proj.weight"
O_PROJ = "model.layers.{i}.self_attn.o_proj.weight"
NORM = "model.layers.{i}.input_layernorm.weight"
ATTENTION = "model.layers.{i}.self_attn"
EXPERTS = "model.layers.{i}.mlp.experts.gate_up_proj"
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"

#: The dense axes outside ``dp_shard_cp``: ranks equal on these hold the FSDP slices of one tensor.
_OUTSIDE_FSDP_SHARD: tuple[str, ...] = tuple(
    a for a in dense_axes() if a not in flattened_axes()["dp_shard_cp"]
)


def placement_on(entry: dict[str, Any], axis: str) -> str | None:
    """The placement of a reported tensor on mesh `axis` (None: not distributed over it)."""
    mesh = entry["mesh"] or []
    return entry["placements"][mesh.index(axis)] if axis in mesh else None


def _is_dim0_shard(placement: str | None) -> bool:
    # "S(0)" is a plain dim-0 shard; "_S(0, k)" the strided dim-0 shard FSDP uses on top of TP.
    return placement is not None and (placement.startswith("S(0)") or placement.startswith("_S(0,"))


def _params(report: Report) -> dict[str, dict[str, Any]]:
    merged: dict[str, dict[str, Any]] = {}
    for part in report["parts"]:
        merged.update(part["parameters"])
    return merged


def _layers(report: Report) -> list[int]:
    return sorted(i for part in report["parts"] for i in part["layers"])


def _check_replicated(reports: list[Report], ranks: int) -> None:
    """The whole model wrapped with a gradient reducer over all `ranks`; every parameter whole."""
    for report in reports:
        (part,) = report["parts"]
        assert part["wrapper"] == "DistributedDataParallel", (
            f"rank {report['rank']}: not DDP-wrapped: {part['wrapper']}"
        )
        assert part["ddp"] == {"reducer": True, "group_size": ranks}, f"rank {report['rank']}: {part['ddp']}"
        for name, entry in part["parameters"].items():
            assert entry["mesh"] is None and entry["local_shape"] == entry["shape"], (
                report["rank"],
                name,
                entry,
            )


def _check_fsdp(reports: list[Report], shards: int, *, replicate: int = 1) -> None:
    """Every parameter dim-0 sharded over ``dp_shard_cp`` (`shards` ranks), replicated over ``dp_replicate``."""
    for report in reports:
        for name, entry in _params(report).items():
            on_shard = placement_on(entry, "dp_shard_cp")
            if "experts" in name:
                continue  # expert weights are sharded over ep_shard / ep (check_ep)
            assert _is_dim0_shard(on_shard), (
                f"rank {report['rank']}: {name} not sharded on dp_shard_cp: {entry}"
            )
            if shards > 1 and entry["shape"][0] >= shards:
                assert entry["local_shape"][0] < entry["shape"][0], (report["rank"], name, entry)
            if replicate > 1:
                assert placement_on(entry, "dp_replicate") == "R", (report["rank"], name, entry)
        for part in report["parts"]:
            units = set(part["fsdp_units"])
            expected = {"<root>"} | {f"model.layers.{i}" for i in part["layers"]}
            assert expected <= units, (
                f"rank {report['rank']}: FSDP units {sorted(units)} miss {sorted(expected - units)}"
            )
    if shards > 1:
        # Ranks that differ only in their dp_shard / cp coordinates hold different slices.
        offsets: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
        for report in reports:
            c = report["coordinates"]
            norm = _params(report)[NORM.format(i=_layers(report)[0])]
            offsets[tuple(c[a] for a in _OUTSIDE_FSDP_SHARD)].append(tuple(norm["offset"]))
        for key, found in offsets.items():
            assert len(found) == shards and len(set(found)) == shards, (
                f"({', '.join(_OUTSIDE_FSDP_SHARD)})={key}: {found}"
            )


def _check_tp(reports: list[Report], tp: int, *, sequence_parallel: bool) -> None:
    """Attention column-/row-sharded over ``tp``; norms on the tp mesh only with SP."""
    for report in reports:
        params = _params(report)
        for i in _layers(report):
            q, o, norm = params[Q_PROJ.format(i=i)], params[O_PROJ.format(i=i)], params[NORM.format(i=i)]
            assert placement_on(q, "tp") == "S(0)", f"rank {report['rank']}: q_proj not colwise on tp: {q}"
            assert placement_on(o, "tp") == "S(1)", f"rank {report['rank']}: o_proj not rowwise on tp: {o}"
            assert q["local_shape"][0] * tp <= q["shape"][0], (report["rank"], q)
            assert o["local_shape"][1] * tp == o["shape"][1], (report["rank"], o)
            if sequence_parallel:
                assert placement_on(norm, "tp") == "R", (
                    f"rank {report['rank']}: SP norm not on the tp mesh: {norm}"
                )
            else:
                assert placement_on(norm, "tp") is None, (
                    f"rank {report['rank']}: norm on tp without SP: {norm}"
                )


def _check_pp(reports: list[Report], *, layers: int, dp_copies: int) -> None:
    """Each rank holds stage modules with a strict subset of the layers; each layer lives on
    `dp_copies` ranks (the data-parallel replicas of its stage); stages hold the layers in order
    (every layer of stage s before every layer of stage s + 1); embedding first, head last."""
    held = Counter(i for report in reports for i in _layers(report))
    assert held == Counter({i: dp_copies for i in range(layers)}), f"layers per rank count: {held}"
    by_stage: dict[int, set[int]] = defaultdict(set)
    for report in reports:
        for part in report["parts"]:
            by_stage[part["stage_ids"][0]].update(part["layers"])
    ordered = [sorted(by_stage[s]) for s in sorted(by_stage)]
    assert all(a[-1] < b[0] for a, b in zip(ordered, ordered[1:]) if a and b), f"layers by stage: {ordered}"
    last_stage = max(s for report in reports for part in report["parts"] for s in part["stage_ids"])
    for report in reports:
        assert len(_layers(report)) < layers, f"rank {report['rank']} holds every layer: {_layers(report)}"
        for part in report["parts"]:
            (stage,) = part["stage_ids"]
            assert (EMBED in part["parameters"]) == (stage == 0), (
                report["rank"],
                stage,
                sorted(part["parameters"]),
            )
            assert (HEAD in part["parameters"]) == (stage == last_stage), (report["rank"], stage)


def _check_cp(reports: list[Report]) -> None:
    """The ring backend, and every attention module a rank holds carrying the CP group and hooks
    (``cp_attention``, what `recipes train`'s report reads off the live modules)."""
    for report in reports:
        assert report["cp_backend"] == "ring", f"rank {report['rank']}: cp_backend {report['cp_backend']!r}"
        for part in report["parts"]:
            expected = {ATTENTION.format(i=i) for i in part["layers"]}
            hooked = set(part.get("cp_attention", ()))
            assert expected <= hooked, (
                f"rank {report['rank']}: attention without CP hooks: {sorted(expected - hooked)}"
            )


def _check_ep(reports: list[Report], ep: int, *, num_experts: int, ep_shard: int) -> None:
    """Each rank holds experts of ``[e * E/ep, (e+1) * E/ep)`` for its ep coordinate e; with
    ``ep_shard`` > 1 FSDP splits those E/ep experts further over the ep_shard ranks."""
    local = num_experts // ep
    for report in reports:
        params, e = _params(report), report["coordinates"]["ep"]
        for i in _layers(report):
            entry = params[EXPERTS.format(i=i)]
            assert placement_on(entry, "ep") == "S(0)", (
                f"rank {report['rank']}: experts not sharded on ep: {entry}"
            )
            assert entry["local_shape"][0] * ep_shard == local, (report["rank"], ep_shard, entry)
            assert e * local <= entry["offset"][0] < (e + 1) * local, (report["rank"], entry)
            if ep_shard > 1:
                assert _is_dim0_shard(placement_on(entry, "ep_shard")), (report["rank"], entry)


def _check_activation_checkpointing(reports: list[Report]) -> None:
    """Every decoder layer a rank holds is activation-checkpointed (and nothing else)."""
    for report in reports:
        for part in report["parts"]:
            expected = sorted(f"model.layers.{i}" for i in part["layers"])
            assert part["checkpointed"] == expected, (
                f"rank {report['rank']}: checkpointed {part['checkpointed']}, expected {expected}"
            )


def _check_experts_replicated(reports: list[Report], *, num_experts: int) -> None:
    for report in reports:
        params = _params(report)
        for i in _layers(report):
            entry = params[EXPERTS.format(i=i)]
            assert placement_on(entry, "tp") is None and entry["local_shape"][0] == num_experts, entry


def _sizes(layout: Layout) -> tuple[int, int, int, int, int]:
    """(tp, pp, cp, ep, dp) of `layout`."""
    tp, pp, cp, ep = (layout.axis_size(a) for a in ("tp", "pp", "cp", "ep"))
    return tp, pp, cp, ep, layout.dp


def check_layout_applied(
    reports: list[Report],
    *,
    layout: Layout,
    layers: int,
    num_experts: int | None,
    any_architecture: bool = False,
) -> None:
    """AssertionError unless every rank's report (`automodel.mesh.layout_report`) holds what
    `layout` (a `automodel.testing.layout_table` entry) asks for, on a model of `layers` decoder
    layers and `num_experts` experts (0 or None: dense). A composed layout gets the check of each axis.

    By default the tiny models' parameter names (`automodel.testing.tiny_model`: Llama, Qwen3,
    the MoE families) are checked exactly; `any_architecture` checks the same per axis generically,
    the decoder layers found from each report's ``layers_fqn`` (the conformance sweep)."""
    ranks = layout.ranks
    assert len(reports) == ranks, f"{len(reports)} reports for {ranks} ranks"
    if any_architecture:
        _check_any_architecture(reports, layout=layout, num_layers=layers, num_experts=num_experts)
        return
    tp, pp, cp, ep, dp = _sizes(layout)
    replicate = layout.axis_size("dp_replicate")
    if layout.activation_checkpointing:
        _check_activation_checkpointing(reports)
    if layout.replicated:
        _check_replicated(reports, ranks)
        return
    if dp * cp > 1:
        _check_fsdp(reports, dp * cp // replicate, replicate=replicate)
    if tp > 1:
        _check_tp(reports, tp, sequence_parallel=layout.sequence_parallel)
    if pp > 1:
        _check_pp(reports, layers=layers, dp_copies=dp * cp * tp)
    if cp > 1:
        _check_cp(reports)
    if ep > 1:
        _check_ep(reports, ep, num_experts=num_experts or 0, ep_shard=ranks // (pp * tp * ep))
    elif num_experts:
        _check_experts_replicated(reports, num_experts=num_experts)


# ---- any architecture (the conformance sweep) ----------------------------------------------
def _layer_of(name: str, layers_fqn: str) -> int | None:
    if not name.startswith(layers_fqn + "."):
        return None
    head = name[len(layers_fqn) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _check_any_architecture(
    reports: list[Report], *, layout: Layout, num_layers: int, num_experts: int | None
) -> None:
    tp, pp, cp, ep, dp = _sizes(layout)
    for report in reports:
        params = _params(report)
        layers_fqn = next((p["layers_fqn"] for p in report["parts"] if p.get("layers_fqn")), None)
        assert layers_fqn, f"rank {report['rank']}: no decoder layer list found in its report"
        held = sorted({i for part in report["parts"] for i in part["layers"]})
        if dp > 1 and ep == 1:
            for name, entry in params.items():
                if "experts" not in name:
                    placement = placement_on(entry, "dp_shard_cp") or ""
                    split = entry["local_shape"][0] < entry["shape"][0] or entry["shape"][0] < 2
                    assert placement.startswith(("S(0)", "_S(0,")) and split, (
                        f"{name} not FSDP-sharded: {entry}"
                    )
        if tp > 1:
            for i in held:
                sharded = [
                    n
                    for n, e in params.items()
                    if _layer_of(n, layers_fqn) == i and (placement_on(e, "tp") or "").startswith("S(")
                ]
                assert sharded, f"rank {report['rank']}: nothing in layer {i} is sharded over tp"
            norms = [
                n for n, e in params.items() if _layer_of(n, layers_fqn) is not None and len(e["shape"]) == 1
            ]
            if layout.sequence_parallel and norms:  # (OLMo's norms have no weights to place)
                on_tp = [n for n in norms if placement_on(params[n], "tp") == "R"]
                assert on_tp, f"rank {report['rank']}: no norm weight on the tp mesh under SP"
        if pp > 1:
            assert 0 < len(held) < num_layers, f"rank {report['rank']} holds layers {held} of {num_layers}"
            if layout.activation_checkpointing:
                assert all(part["checkpointed"] for part in report["parts"]), f"rank {report['rank']}: no AC"
        if cp > 1:
            assert report["cp_backend"] == "ring", f"rank {report['rank']}: cp_backend {report['cp_backend']}"
        if ep > 1:
            # expert parameters: under an `experts` module, or split over ep wherever they live (JetMoE's
            # mlp.input_linear.weight)
            experts = {
                n: e for n, e in params.items() if ".experts." in f".{n}" or placement_on(e, "ep") is not None
            }
            assert experts and num_experts, f"rank {report['rank']}: no expert parameters"
            ep_shard = dp * cp // ep  # the ranks holding the same experts, which FSDP2 shards them over
            for name, entry in experts.items():
                if placement_on(entry, "ep") is not None:
                    rows = entry["shape"][0]  # E rows, or E blocks of k rows (DBRX's mlp.w1 [E*F, H])
                    on_dim0 = (placement_on(entry, "ep_shard") or "").startswith(("S(0)", "_S(0,"))
                    split = ep * (ep_shard if on_dim0 else 1)  # FSDP2 may shard dim 1 instead
                    local = entry["local_shape"][0]
                    assert rows % num_experts == 0 and local in (rows // split, -(-rows // split)), (
                        name,
                        entry,
                    )
            assert any(placement_on(e, "ep") == "S(0)" for e in experts.values()), (
                "no expert is split over ep"
            )
    if pp > 1:  # the pp coordinates hold disjoint layers, together all of them; a stage's ranks alike
        by_stage: dict[int, set[int]] = {}
        for r in reports:
            layers = {i for part in r["parts"] for i in part["layers"]}
            assert by_stage.setdefault(r["coordinates"]["pp"], layers) == layers, (r["rank"], layers)
        stages = list(by_stage.values())
        assert sum(len(x) for x in stages) == len(set().union(*stages)) == num_layers, by_stage
