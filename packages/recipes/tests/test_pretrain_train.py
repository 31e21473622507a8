"""Training on a memory-mapped Megatron corpus: exact mid-epoch resume after dp 2 -> 4 (same global
batch), and a clean stop at the end of the data."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import assert_losses_close, preload, tiny_config, train_on_rank  # noqa: E402

from automodel.data.megatron_writer import MegatronWriter  # noqa: E402

preload()

TIMEOUT = 300


def byte_corpus(prefix: Path, *, docs: int, seed: int = 0) -> str:
    """Documents of printable bytes, EOS (0) appended: what `recipes preprocess` writes for the
    byte tokenizer (uint8 tokens)."""
    rng = np.random.default_rng(seed)
    w = MegatronWriter(prefix, dtype=np.uint8)
    for _ in range(docs):
        w.add_document(rng.integers(32, 127, int(rng.integers(10, 80))).tolist() + [0])
    w.finalize()
    return str(prefix)


def _config(out: Path, prefix: str, *, data: dict | None = None, validation: bool = True, **sections) -> dict:
    cfg = tiny_config(str(out), **sections)
    cfg["dataset"] = {
        "source": "megatron",
        "paths": prefix,
        "seq_length": 32,
        "split": "95,5,0",
        **(data or {}),
    }
    cfg["validation_dataset"] = {**cfg["dataset"], "splits_to_build": "validation"} if validation else None
    return cfg


def test_resume_after_dp2_to_dp4_continues_exactly(tmp_path: Path) -> None:
    prefix = byte_corpus(tmp_path / "corpus", docs=400)
    steps = {"max_steps": 5, "val_every_steps": None, "ckpt_every_steps": 3}
    sched = {"decay_steps": 4}
    full = _config(
        tmp_path / "full", prefix, step_scheduler={**steps, "ckpt_every_steps": None}, lr_scheduler=sched
    )
    (uninterrupted,) = run_on_ranks(train_on_rank, world_size=1, args=(full,), timeout_s=TIMEOUT)
    ckpt = {"enabled": True, "save_consolidated": False}
    first = _config(
        tmp_path / "run",
        prefix,
        step_scheduler={**steps, "max_steps": 3},
        checkpoint=ckpt,
        lr_scheduler=sched,
    )
    run_on_ranks(train_on_rank, world_size=2, args=(first,), timeout_s=TIMEOUT)
    second = _config(tmp_path / "run", prefix, step_scheduler=steps, checkpoint=ckpt, lr_scheduler=sched)
    resumed = run_on_ranks(train_on_rank, world_size=4, args=(second,), timeout_s=TIMEOUT)[0]
    # steps 4, 5 and the final validation loss, as in the uninterrupted single-process run
    assert_losses_close(resumed, uninterrupted[3:])


def test_end_of_data_stops_cleanly_with_packed_documents(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    prefix = byte_corpus(tmp_path / "small", docs=30)  # ~1400 tokens: 43 samples of 33, 5 global batches
    cfg = _config(
        tmp_path / "out",
        prefix,
        data={"split": "1,0,0"},
        validation=False,
        step_scheduler={"max_steps": 100, "num_epochs": 1, "val_every_steps": None, "local_batch_size": 1},
        packed_sequence={"packed_sequence_size": 32},
    )
    (losses,) = run_on_ranks(train_on_rank, world_size=1, args=(cfg,), timeout_s=TIMEOUT)
    records = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    samples = (Path(prefix + ".bin").stat().st_size - 1) // 32  # Megatron windows of 33, stride 32
    assert len(losses) == len(records) == samples // 8  # one epoch of global batches of 8, then stop
    n = samples // 8  # and it says why it stopped before max_steps (issue 43)
    assert (
        f"step_scheduler: the data ended at step {n} of step_scheduler.max_steps=100: 1 epoch(s) of {n} "
        f"steps (step_scheduler.num_epochs=1); set step_scheduler.num_epochs={-(-100 // n)} to reach max_steps"
    ) in capfd.readouterr().err.splitlines()
    # no index_mapping_dir: the order is cached under output_dir, so a restart maps it
    cache = tmp_path / "out" / "cache" / "megatron_index"
    arrays = {p.name.split("GPTDataset-train-", 1)[1] for p in cache.glob("*GPTDataset-train-*.npy")}
    assert arrays == {"document_index.npy", "document_starts.npy", "shuffle_index.npy"}
    assert len(list(cache.glob("*-description.json"))) == 1
