"""`recipes train` on data that is not what it claims (issue 43): refused before launch with exit 2
and one line naming the file (nothing written), found in the ranks as one line naming the file
and token, or, for a run whose data ends before max_steps, one line saying so.

The pre-launch cases run in-process (`run_cli`) in the CPU suite; the ones that start ranks are
``full_only`` (`nox -s faults`, ``AUTOMODEL_FAULTS=all``).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from automodel.data.megatron_writer import MegatronWriter
from automodel.data.nanogpt_shard import LEGACY_MAGIC, write_nanogpt_shard
from automodel.data.token_ids import SAMPLE_TOKENS
from automodel.recipes.cli import run_cli

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))
from _launch_helpers import clean_env  # noqa: E402
from _recipe_helpers import tiny_config, write_sparse_tokenizer  # noqa: E402

from automodel.testing.faults import full_only  # noqa: E402


def _megatron(prefix: Path, flat: list[int], *, doc: int = 100) -> str:
    w = MegatronWriter(prefix, dtype=np.uint16)
    for i in range(0, len(flat), doc):
        w.add_document(flat[i : i + doc])
    w.finalize()
    return str(prefix)


def _byte_ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, n).tolist()


# ---- before launch -------------------------------------------------------------------------------
def _missing_key(tmp: Path) -> tuple[dict, str]:
    path = tmp / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"text": "abc " * 50}, {"body": "x"}] * 20))
    return {"dataset": {"source": "json", "path": str(path)}}, f"error: {path}:2: the row has no 'text' key"


def _nanogpt_magic(tmp: Path) -> tuple[dict, str]:
    path = tmp / "shard.bin"
    write_nanogpt_shard(path, np.array(_byte_ids(4000)))
    raw = bytearray(path.read_bytes())
    raw[:4] = struct.pack("<i", LEGACY_MAGIC + 1)
    path.write_bytes(bytes(raw))
    data = {"source": "nanogpt", "file_pattern": str(path), "seq_len": 32}
    return {"dataset": data}, f"error: dataset.file_pattern='{path}': has a nanoGPT header (4000 tokens"


def _megatron_version(tmp: Path) -> tuple[dict, str]:
    prefix = _megatron(tmp / "c", _byte_ids(4000))
    idx = Path(prefix + ".idx")
    raw = bytearray(idx.read_bytes())
    raw[9:17] = struct.pack("<Q", 3)
    idx.write_bytes(bytes(raw))
    data = {"source": "megatron", "paths": prefix, "split": "1,0,0", "seq_length": 32}
    return {"dataset": data}, f"error: dataset.paths='{idx}': has index version 3; only version 1 is read"


def _megatron_wide_ids(tmp: Path) -> tuple[dict, str]:
    flat = np.random.default_rng(0).integers(1, 1000, 4000).tolist()  # uint16 ids up to 999
    prefix = _megatron(tmp / "wide", flat)
    first = next(i for i, t in enumerate(flat) if t >= 256)
    data = {"source": "megatron", "paths": prefix, "split": "1,0,0", "seq_length": 32}
    return {"dataset": data}, f"error: {prefix}.bin: token {first} is id {flat[first]}, outside the model's"


def _sparse_tokenizer(tmp: Path) -> tuple[dict, str]:
    write_sparse_tokenizer(tmp / "tok")
    return (
        {"tokenizer": {"path": str(tmp / "tok")}},
        f"error: tokenizer.path='{tmp / 'tok'}': the tokenizer yields id 2000000000 ('z'), outside",
    )


@pytest.mark.parametrize(
    "case", [_missing_key, _nanogpt_magic, _megatron_version, _megatron_wide_ids, _sparse_tokenizer]
)
def test_refused_before_launch_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, case: Callable[[Path], tuple[dict, str]]
) -> None:
    sections, want = case(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    out = tmp_path / "run"
    cfg = tiny_config(str(out), validation_dataset=None)
    cfg.update(sections)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    assert run_cli(["train", str(tmp_path / "cfg.yaml")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(want), line
    assert not out.exists()  # nothing written, no rank started
    assert {p: p.read_bytes() for p in before} == before  # the data is left as it was


# ---- in the ranks --------------------------------------------------------------------------------
def _train(tmp: Path, cfg: dict[str, Any], *, nproc: int = 1) -> subprocess.CompletedProcess:
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [
        sys.executable,
        "-m",
        "automodel.recipes.cli",
        "train",
        str(tmp / "cfg.yaml"),
        f"--nproc-per-node={nproc}",
    ]
    return subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), cwd=tmp, timeout=600)


def _ids_beyond_vocab_in_the_middle(tmp: Path) -> tuple[str, set[int]]:
    """A uint16 corpus of byte ids whose sampled ends are clean and whose middle holds id 999 every
    97 tokens (so the first batch meets one)."""
    n = 4 * SAMPLE_TOKENS
    flat = _byte_ids(n)
    bad = set(range(SAMPLE_TOKENS + 50, n - SAMPLE_TOKENS - 50, 97))
    for i in bad:
        flat[i] = 999
    return _megatron(tmp / "corpus", flat), bad


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


@full_only
@pytest.mark.parametrize("pp", [1, 2])
def test_an_id_beyond_vocab_size_in_a_batch_is_one_line_naming_file_and_token(
    tmp_path: Path, pp: int
) -> None:
    prefix, bad = _ids_beyond_vocab_in_the_middle(tmp_path)
    data = {"source": "megatron", "paths": prefix, "split": "1,0,0", "seq_length": 32}
    dist = (
        {"strategy": "fsdp2", "pp_size": 2, "pipeline": {"pp_microbatch_size": 1}}
        if pp == 2
        else {"strategy": "fsdp2"}
    )
    cfg = tiny_config(str(tmp_path / "run"), validation_dataset=None, distributed=dist)
    cfg["dataset"] = data
    line = _one_error_line(_train(tmp_path, cfg, nproc=pp))
    head, _, rest = line.removeprefix("error: ").partition(": token ")
    assert head == f"{prefix}.bin", line
    token = int(rest.split(" ")[0])
    assert token in bad and "is id 999, outside the model's vocab_size 256 (ids 0..255)" in rest, line


@full_only  # the line from the loop: test_pretrain_train.py in the CPU suite
def test_a_run_whose_data_ends_before_max_steps_says_so(tmp_path: Path) -> None:
    """26 steps of data under max_steps: 500: the run ends at step 26 (exit 0) and says why."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i:03d} " + "ab" * 98}) + "\n" for i in range(138)))
    data = {"source": "json", "path": str(path), "seq_length": 32}
    steps = {"max_steps": 500, "val_every_steps": None, "global_batch_size": 32, "local_batch_size": 32}
    cfg = tiny_config(str(tmp_path / "run"), validation_dataset=None, step_scheduler=steps)
    cfg["dataset"] = data
    proc = _train(tmp_path, cfg)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 26
    assert (
        "step_scheduler: the data ended at step 26 of step_scheduler.max_steps=500: 1 epoch(s) of 26 "
        "steps (step_scheduler.num_epochs=1); set step_scheduler.num_epochs=20 to reach max_steps"
    ) in proc.stderr.splitlines()


def _run_length(raw: dict[str, Any]) -> tuple[int, int]:
    """Rank body: build the run (data, model, loader) without training; its epoch and length."""
    from automodel.recipes import load_config
    from automodel.recipes.trainer import Trainer

    trainer = Trainer(load_config(raw))
    trainer.build()
    return trainer.steps_per_epoch, trainer.total_steps


@full_only  # ~10-30 s; the dataset itself: test_data_exact.py in the CPU suite
def test_a_corpus_over_2m_characters_is_trained_on_whole(tmp_path: Path) -> None:
    """The issue's case: a 2.2M-character corpus ran 30 steps of an epoch of about 41 (cut at the
    old 2,000,000 default); the run is now the whole epoch (built in a rank, not trained: an epoch
    of 2.2M tokens takes minutes on CPU)."""
    from automodel.testing.ranks import run_on_ranks

    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": f"{i:05d} " + "x" * 9993 + "\n"}) + "\n" for i in range(220)))
    model = {"config": {**tiny_config("x")["model"]["config"], "max_position_embeddings": 1024}}
    steps = {"max_steps": None, "val_every_steps": None, "global_batch_size": 52, "local_batch_size": 4}
    cfg = tiny_config(str(tmp_path / "run"), validation_dataset=None, step_scheduler=steps, model=model)
    cfg["dataset"] = {"source": "json", "path": str(path), "seq_length": 1023}
    ((per_epoch, total),) = run_on_ranks(_run_length, world_size=1, args=(cfg,), timeout_s=300)
    rows = (2_200_000 + 220) // 1024  # every character and an EOS per document: 2148 rows
    assert per_epoch == total == rows // 52 == 41
