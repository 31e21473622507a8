"""The shared applied-layout checker fails a run whose parallelism was silently off.

Every layout of the shared table (`automodel.testing.layout_table`), checked against one process's
report of its tiny model standing in for each rank, must fail: otherwise a package test could pass
a layout on parity alone. One process also passes the check of the one-rank layout it is.
"""

from __future__ import annotations

import pytest

from automodel.mesh import axes
from automodel.mesh.layout_report import default_layers_fqn, describe_module
from automodel.testing.layout_check import check_layout_applied
from automodel.testing.layout_table import LAYOUTS, MATRIX_LAYOUTS, Layout, layouts_named

pytest.importorskip("transformers")

from automodel.testing.tiny_model import TINY_MOE_SIZES, tiny_causal_lm  # noqa: E402

_COORDS = {a.name: 0 for a in axes() if a.mesh != "flattened"}
_MODEL_TYPE = {"dense": "llama", "moe": "qwen3_moe"}


def _single_process_report(model: str, rank: int = 0) -> dict:
    lm = tiny_causal_lm(_MODEL_TYPE.get(model, model), meta=True)
    part = describe_module(lm, layers_fqn=default_layers_fqn(lm))
    coords = {**_COORDS, "pp": rank % 2}
    return {"rank": rank, "strategy": "fsdp2", "coordinates": coords, "cp_backend": "none", "parts": [part]}


def _experts(layout: Layout) -> int:
    return TINY_MOE_SIZES["num_experts"] if layout.model == "moe" else 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_one_process_standing_in_for_every_rank_fails(layout: Layout) -> None:
    stand_ins = [_single_process_report(layout.model, rank) for rank in range(layout.ranks)]
    with pytest.raises(AssertionError):
        check_layout_applied(stand_ins, layout=layout, layers=2, num_experts=_experts(layout))


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_one_process_passes_the_one_rank_layout(model: str) -> None:
    report = _single_process_report(model)
    one_rank = Layout("one_process", 1, {}, model=model)
    num_experts = _experts(one_rank)
    check_layout_applied([report], layout=one_rank, layers=2, num_experts=num_experts)
    check_layout_applied(
        [report], layout=one_rank, layers=2, num_experts=num_experts or None, any_architecture=True
    )


def test_the_table_has_one_entry_per_name_and_the_matrix_is_its_marked_part() -> None:
    names = [layout.name for layout in LAYOUTS]
    assert len(names) == len(set(names))
    assert MATRIX_LAYOUTS == [layout for layout in LAYOUTS if layout.in_matrix]
    (tp2,) = layouts_named("tp2")
    assert tp2.sizes().tp_size == 2 and tp2.axes == {"tp"} and tp2.dp == 1
    with pytest.raises(KeyError):
        layouts_named("no_such_layout")


def test_the_entry_not_the_strategy_name_says_replicated() -> None:
    """Reports of a whole model under a 2-rank gradient reducer pass an entry marked ``replicated``
    whatever its section names, and fail the same sizes unmarked (checked as FSDP shards)."""
    reports = []
    for rank in range(2):
        report = _single_process_report("dense", rank)
        (part,) = report["parts"]
        part.update(wrapper="DistributedDataParallel", ddp={"reducer": True, "group_size": 2})
        reports.append({**report, "coordinates": dict(_COORDS)})
    check_layout_applied(reports, layout=Layout("copies", 2, {}, replicated=True), layers=2, num_experts=0)
    with pytest.raises(AssertionError, match="not sharded on dp_shard_cp"):
        check_layout_applied(
            reports, layout=Layout("shards", 2, {"strategy": "ddp"}), layers=2, num_experts=0
        )
