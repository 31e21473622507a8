"""SFT through the recipes: answer-only instruction data trains the same in every layout as in one
process (fp32 losses to 1e-5), padded rows and packed rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import assert_losses_close, preload, tiny_config, train_on_rank  # noqa: E402
from _sft_helpers import arithmetic_instruction_section  # noqa: E402

preload()

TIMEOUT = 300


def _sft_config(tmp: Path, out: str, *, packed: int = 0, **sections) -> dict:
    dataset = arithmetic_instruction_section(tmp, seq_length=16)
    cfg = tiny_config(
        out,
        dataset=None,
        validation_dataset=None,
        step_scheduler={"max_steps": 3, "val_every_steps": 3},
        **sections,
    )
    cfg["dataset"] = dataset
    cfg["validation_dataset"] = {**dataset, "limit_dataset_samples": 32}
    if packed:
        cfg["packed_sequence"] = {"packed_sequence_size": packed}
        cfg["step_scheduler"] = {**cfg["step_scheduler"], "global_batch_size": 4, "local_batch_size": 1}
    return cfg


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    tmp = tmp_path_factory.mktemp("sft_ref")
    (losses,) = run_on_ranks(
        train_on_rank, world_size=1, args=(_sft_config(tmp, str(tmp / "out")),), timeout_s=TIMEOUT
    )
    assert losses[2] < losses[0], losses
    return losses


LAYOUTS = {
    "fsdp2_dp2": {"strategy": "fsdp2"},
    "tp2": {"strategy": "fsdp2", "tp_size": 2},
    "pp2": {"strategy": "fsdp2", "pp_size": 2, "pipeline": {"pp_schedule": "1f1b", "pp_microbatch_size": 1}},
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_layout_equals_one_process(layout: str, reference: list[float], tmp_path: Path) -> None:
    cfg = _sft_config(tmp_path, str(tmp_path / "out"), distributed=LAYOUTS[layout])
    for rank_losses in run_on_ranks(train_on_rank, world_size=2, args=(cfg,), timeout_s=TIMEOUT):
        assert_losses_close(rank_losses, reference)


@pytest.mark.parametrize("layout", ["fsdp2_dp2", "cp2"])
def test_packed_sft_equals_one_process(layout: str, tmp_path: Path) -> None:
    ref_cfg = _sft_config(tmp_path, str(tmp_path / "ref"), packed=64)
    (ref,) = run_on_ranks(train_on_rank, world_size=1, args=(ref_cfg,), timeout_s=TIMEOUT)
    dist = {"strategy": "fsdp2"} if layout == "fsdp2_dp2" else {"strategy": "fsdp2", "cp_size": 2}
    cfg = _sft_config(tmp_path, str(tmp_path / "out"), packed=64, distributed=dist)
    for rank_losses in run_on_ranks(train_on_rank, world_size=2, args=(cfg,), timeout_s=TIMEOUT):
        assert_losses_close(rank_losses, ref)
