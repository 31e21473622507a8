"""Streaming pretraining data (HF ``datasets`` streaming over local files): each dp rank reads its
own share, windows are packed on the fly, and the checkpointed stream state resumes exactly."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from automodel.data.streaming_section import StreamingSection
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import assert_losses_close, preload, tiny_config, train_on_rank  # noqa: E402

from automodel.data.api import build_loader  # noqa: E402
from automodel.data.streaming import build_streaming  # noqa: E402
from automodel.data.tokenizer import ByteTokenizer  # noqa: E402
from automodel.recipes.data.kinds import parse_section  # noqa: E402
from automodel.recipes.errors import ConfigError  # noqa: E402

preload()

TIMEOUT = 300


def write_jsonl(folder: Path, *, files: int, docs: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(folder / f"part_{f}.jsonl", "w") as out:
            for d in range(docs):
                text = f"f{f}d{d} " + "".join(chr(c) for c in rng.integers(97, 123, int(rng.integers(5, 60))))
                out.write(json.dumps({"text": text, "id": d}) + "\n")
    return str(folder)


def loaders(section: StreamingSection, *, dp: int, gbs: int = 4, lbs: int = 1) -> list[Any]:
    ds = build_streaming(section, ByteTokenizer(), packed_sequence_size=0, seed=0)
    return [
        build_loader(ds, global_batch_size=gbs, local_batch_size=lbs, dp_rank=r, dp_size=dp, seed=0)
        for r in range(dp)
    ]


def steps(ranks: list[Any], n: int) -> list[list[list[int]]]:
    """Per step, every rank's rows (rank 0's first)."""
    return [[row for ld in ranks for b in ld.next_step() for row in b.input_ids.tolist()] for _ in range(n)]


@pytest.mark.parametrize("files", [2, 3])  # whole files per rank (2), or every 2nd document (3)
def test_ranks_read_disjoint_shares_and_resume_exactly(tmp_path: Path, files: int) -> None:
    folder = write_jsonl(tmp_path / "data", files=files, docs=15)
    section = parse_section({"source": "streaming", "path": folder, "seq_length": 16}, validation=False)
    straight = steps(loaders(section, dp=2), 40)  # more than one pass over each share
    first = loaders(section, dp=2)
    head = steps(first, 11)
    saved = [json.loads(json.dumps(ld.state_dict())) for ld in first]  # the checkpoint's JSON round trip
    resumed = loaders(section, dp=2)
    for ld, state in zip(resumed, saved):
        ld.load_state_dict(state)
    assert head + steps(resumed, 29) == straight
    assert max(ld.stream.epoch for ld in resumed) >= 1  # the resume crossed an end of the share
    # no two ranks read the same document: each rank's text names only its own documents
    tok = ByteTokenizer()
    shares = [set(), set()]
    for step in straight:
        for r in (0, 1):
            for row in step[r * 2 : r * 2 + 2]:
                docs = tok.decode([t if t else ord("|") for t in row]).split("|")[1:]  # whole document starts
                shares[r] |= {d.split()[0] for d in docs if re.fullmatch(r"f\d+d\d+ .*", d)}
    assert shares[0] and shares[1] and not (shares[0] & shares[1])


def test_other_dp_size_is_refused_with_the_reason(tmp_path: Path) -> None:
    section = parse_section(
        {"source": "streaming", "path": write_jsonl(tmp_path, files=2, docs=5)}, validation=False
    )
    state = loaders(section, dp=2)[0].state_dict()
    with pytest.raises(ConfigError, match="cannot resume exactly on dp rank 0 of 4") as e:
        loaders(section, dp=4)[0].load_state_dict(state)
    assert e.value.key == "dataset.source"


def test_bad_sections_and_files_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        parse_section({"source": "streaming"}, validation=False)
    assert e.value.key == "dataset.path"
    missing = parse_section({"source": "streaming", "path": str(tmp_path / "none.jsonl")}, validation=False)
    with pytest.raises(ConfigError, match="matches no files"):
        build_streaming(missing, ByteTokenizer(), packed_sequence_size=0, seed=0)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    no_text = parse_section({"source": "streaming", "path": str(tmp_path / "d")}, validation=False)
    with pytest.raises(ConfigError) as e:
        loaders(no_text, dp=1)[0].next_step()
    assert e.value.key == "dataset.text_key"


def test_text_and_parquet_files_and_validation_rows(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"line {i} " + "x" * (i % 13) for i in range(200)]
    pq.write_table(pa.table({"content": texts}), tmp_path / "a.parquet")
    (tmp_path / "b.txt").write_text("\n".join(texts) + "\n")
    flat = np.concatenate([np.array(ByteTokenizer().encode(t) + [0]) for t in texts])
    for path, extra in ((tmp_path / "a.parquet", {"text_key": "content"}), (tmp_path / "b.txt", {})):
        val = parse_section(
            {"source": "streaming", "path": str(path), "seq_length": 8, **extra}, validation=True
        )
        assert isinstance(val, StreamingSection)
        rows = build_streaming(val, ByteTokenizer(), packed_sequence_size=0, seed=0)
        assert len(rows) == val.max_rows
        ids, labels, _ = rows.batch([0, 3])
        assert ids[1].tolist() == flat[24:32].tolist() and labels[1].tolist() == flat[25:33].tolist()


def _config(out: Path, folder: str, **sections: Any) -> dict:
    cfg = tiny_config(str(out), **sections)
    cfg["dataset"] = {"source": "streaming", "path": folder, "seq_length": 32}
    cfg["validation_dataset"] = None
    return cfg


def test_two_ranks_checkpoint_and_resume_continue_exactly(tmp_path: Path) -> None:
    folder = write_jsonl(tmp_path / "data", files=2, docs=60)
    steps_ = {"max_steps": 6, "val_every_steps": None}
    sched = {"decay_steps": 5}
    full = _config(tmp_path / "full", folder, step_scheduler=steps_, lr_scheduler=sched)
    uninterrupted = run_on_ranks(train_on_rank, world_size=2, args=(full,), timeout_s=TIMEOUT)[0]
    ckpt = {"enabled": True, "save_consolidated": False}
    first = _config(
        tmp_path / "run", folder, step_scheduler={**steps_, "max_steps": 3, "ckpt_every_steps": 3},
        checkpoint=ckpt, lr_scheduler=sched,
    )  # fmt: skip
    run_on_ranks(train_on_rank, world_size=2, args=(first,), timeout_s=TIMEOUT)
    second = _config(tmp_path / "run", folder, step_scheduler=steps_, checkpoint=ckpt, lr_scheduler=sched)
    resumed = run_on_ranks(train_on_rank, world_size=2, args=(second,), timeout_s=TIMEOUT)[0]
    assert len(uninterrupted) == 6 and len(resumed) == 3
    assert_losses_close(resumed, uninterrupted[3:])


def test_streaming_needs_max_steps(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import yaml

    from automodel.recipes.cli import run_cli

    cfg = _config(tmp_path / "out", str(tmp_path), step_scheduler={"max_steps": None})
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert run_cli(["validate", str(path), "--world-size", "2"]) == 2
    assert "error: step_scheduler.max_steps=None" in capsys.readouterr().err
