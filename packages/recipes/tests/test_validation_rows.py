"""A validation set of any size is evaluated whole, as NeMo AutoModel does: a set smaller than a
global batch (3 rows; rows packed into one, as AutoModel's ``phi_4_hellaswag_fp8`` file's) or one
whose last global batch is partial gives the same per-token loss on 2 ranks (where a rank may
hold no row of the last batch and still runs its forwards) as in one process, with a start-up note."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import assert_losses_close, preload, tiny_config  # noqa: E402
from _sft_helpers import arithmetic_instruction_section  # noqa: E402

preload()

TIMEOUT = 300


def _config(tmp: Path, out: str, *, val_rows: int, packed: int = 0, **sections: Any) -> dict:
    dataset = arithmetic_instruction_section(tmp, seq_length=16)
    steps = {"max_steps": 1, "val_every_steps": 1, "val_batches": None}
    if packed:
        steps |= {"global_batch_size": 4, "local_batch_size": 1}
    cfg = tiny_config(out, step_scheduler=steps, **sections)
    cfg["dataset"] = dataset
    cfg["validation_dataset"] = {**dataset, "limit_dataset_samples": val_rows}
    if packed:
        cfg["packed_sequence"] = {"packed_sequence_size": packed}
    return cfg


def _train_on_rank(raw: dict) -> dict[str, Any]:
    """Rank function: the losses (training, then validation), the validation row count and layout."""
    from automodel.recipes import load_config
    from automodel.recipes.trainer import Trainer

    trainer = Trainer(load_config(raw))
    trainer.build()
    result = trainer.train()
    assert trainer.val_dataset is not None
    layout = trainer.mesh.layout
    return {
        "losses": result.losses + [result.val_losses[k] for k in sorted(result.val_losses)],
        "val_rows": len(trainer.val_dataset),
        "layout": {"dp": layout.dp, "pp": layout.pp},
    }


CASES = {
    # 3 rows, global batch 8, dp 2: rank 1 holds none of them
    "3_rows_dp2": (dict(val_rows=3), {"strategy": "fsdp2"}, {"dp": 2, "pp": 1}),
    # 11 rows: one full global batch, then 3 rows
    "11_rows_dp2": (dict(val_rows=11), {"strategy": "fsdp2"}, {"dp": 2, "pp": 1}),
    # the pipeline takes micro-batches of local_batch_size rows: the last one is filled
    "3_rows_pp2": (
        dict(val_rows=3),
        {"strategy": "fsdp2", "pp_size": 2, "pipeline": {"pp_schedule": "1f1b", "pp_microbatch_size": 1}},
        {"dp": 1, "pp": 2},
    ),
    # 6 examples packed into 1 row of 64 tokens (global batch 4)
    "packed_1_row_dp2": (dict(val_rows=6, packed=64), {"strategy": "fsdp2"}, {"dp": 2, "pp": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_small_validation_set_is_evaluated_exactly(
    case: str, tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    kw, dist, sizes = CASES[case]
    (ref,) = run_on_ranks(
        _train_on_rank,
        world_size=1,
        args=(_config(tmp_path, str(tmp_path / "ref"), **kw),),
        timeout_s=TIMEOUT,
    )
    cfg = _config(tmp_path, str(tmp_path / "out"), distributed=dist, **kw)
    for got in run_on_ranks(_train_on_rank, world_size=2, args=(cfg,), timeout_s=TIMEOUT):
        assert got["layout"] == sizes
        assert got["val_rows"] == ref["val_rows"] == (1 if "packed" in case else kw["val_rows"])
        assert_losses_close(got["losses"], ref["losses"])
        assert abs(got["losses"][-1] - ref["losses"][-1]) < 1e-6
    err = capfd.readouterr().err
    smaller = ref["val_rows"] < (4 if "packed" in case else 8)
    assert ("evaluated as one smaller batch" in err) == smaller
