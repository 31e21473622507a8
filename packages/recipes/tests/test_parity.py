"""The same tiny config trained as 1 process and in every layout gives the same per-step losses."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from automodel.mesh.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import preload, tiny_config, train_on_rank  # noqa: E402

preload()

TIMEOUT = 300
RTOL = 1e-5


def _assert_close(got: list[float], ref: list[float]) -> None:
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref), start=1):
        assert abs(g - r) <= RTOL * abs(r), f"step {step}: {g} vs reference {r}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    out = tmp_path_factory.mktemp("ref")
    (losses,) = run_on_ranks(train_on_rank, world_size=1, args=(tiny_config(str(out)),), timeout_s=TIMEOUT)
    assert losses[-1] < losses[0], losses
    return losses


def test_reference_is_independent_of_accumulation(reference: list[float], tmp_path: Path) -> None:
    cfg = tiny_config(str(tmp_path), step_scheduler={"local_batch_size": 8})
    (losses,) = run_on_ranks(train_on_rank, world_size=1, args=(cfg,), timeout_s=TIMEOUT)
    _assert_close(losses, reference)


LAYOUTS = {
    "fsdp2_dp2": (2, {"strategy": "fsdp2"}),
    "ddp_dp2": (2, {"strategy": "ddp"}),
    "tp2": (2, {"strategy": "fsdp2", "tp_size": 2}),
    "tp2_sp": (2, {"strategy": "fsdp2", "tp_size": 2, "sequence_parallel": True}),
    "hsdp_2x2": (4, {"strategy": "fsdp2", "dp_replicate_size": 2}),
    "fsdp2_dp2_tp2": (4, {"strategy": "fsdp2", "tp_size": 2}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name: str, reference: list[float], tmp_path: Path) -> None:
    world, dist_section = LAYOUTS[name]
    cfg = tiny_config(str(tmp_path), distributed=dist_section)
    results = run_on_ranks(train_on_rank, world_size=world, args=(cfg,), timeout_s=TIMEOUT)
    for rank_losses in results:
        _assert_close(rank_losses, reference)
