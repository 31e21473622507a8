"""Every row-count rule that refuses is checked before launch (`recipes.data.row_counts`).

A training set with fewer rows than ``step_scheduler.global_batch_size`` was refused inside the
ranks, after torchrun had started them and each had built its dataset. Now `recipes validate` and
`recipes train` refuse it before any rank starts (exit 2, one line naming the key and the value,
the rank's own message), for one-example SFT rows, packed SFT rows, ``packed_sequence.max_packs``,
AutoModel's SQuAD factory, pretraining text, a Megatron corpus and a nanoGPT shard; the count is
the ranks' builder's (checked against ``len()`` of the dataset the ranks build), and exactly
``global_batch_size`` rows trains. A resume under another global batch size than its checkpoint's
position is refused before launch too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from automodel.data.megatron_writer import MegatronWriter
from automodel.data.nanogpt_shard import write_nanogpt_shard
from automodel.data.tokenizer import ByteTokenizer
from automodel.recipes import load_config
from automodel.recipes.cli import run_cli
from automodel.recipes.data.kinds import build_packed_dataset, count_rows
from automodel.recipes.errors import ConfigError
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402
from _sft_helpers import write_arithmetic_jsonl  # noqa: E402

GBS = 8


def _sft(tmp: Path, rows: int) -> dict[str, Any]:
    return {
        "source": "instruction",
        "path_or_dataset_id": str(write_arithmetic_jsonl(tmp / "sft.jsonl", n=rows)),
        "column_mapping": {"question": "q", "answer": "a"},
        "answer_only_loss_mask": True,
        "seq_length": 16,
    }


def _megatron(tmp: Path, docs: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    w = MegatronWriter(tmp / "corpus", dtype=np.uint8)
    for _ in range(docs):
        w.add_document(rng.integers(32, 127, 30).tolist() + [0])
    w.finalize()
    return {"source": "megatron", "paths": str(tmp / "corpus"), "seq_length": 32, "split": "1,0,0"}


def _squad(tmp: Path, rows: int) -> dict[str, Any]:
    """NeMo AutoModel's ``make_squad_dataset`` over `rows` SQuAD-format rows in a local file."""
    row = {"context": "c", "question": "q", "answers": {"text": ["a"], "answer_start": [0]}}
    (tmp / "squad.jsonl").write_text((json.dumps(row) + "\n") * rows)
    return {"source": "squad", "dataset_name": str(tmp / "squad.jsonl"), "seq_length": 64}


def _hellaswag(tmp: Path, rows: int) -> dict[str, Any]:
    """NeMo AutoModel's ``HellaSwag`` over `rows` HellaSwag-format rows in a local file."""
    row = {"ctx": "c", "endings": ["a", "b"], "label": "1"}
    (tmp / "hellaswag.jsonl").write_text((json.dumps(row) + "\n") * rows)
    return {"source": "hellaswag", "path_or_dataset": str(tmp / "hellaswag.jsonl"), "seq_length": 64}


def _nanogpt(tmp: Path, tokens: int) -> dict[str, Any]:
    write_nanogpt_shard(tmp / "shard.bin", np.arange(tokens) % 200 + 1)
    return {"source": "nanogpt", "file_pattern": str(tmp / "shard.bin"), "seq_len": 32}


#: case -> (the dataset section for `tmp`, extra config sections): each holds fewer than 8 rows
CASES = {
    "sft_rows": (lambda tmp: _sft(tmp, 5), {}),
    # 40 short examples packed into rows of 64 tokens: fewer than 8 rows
    "sft_packed": (lambda tmp: _sft(tmp, 40), {"packed_sequence": {"packed_sequence_size": 64}}),
    # 200 examples pack into more than 8 rows, but max_packs keeps 6 of them
    "max_packs": (
        lambda tmp: _sft(tmp, 200),
        {"packed_sequence": {"packed_sequence_size": 64, "max_packs": 6}},
    ),
    # the built-in corpus's first 1024 characters: 31 rows of 33 tokens, max_rows keeps 5
    "squad": (lambda tmp: _squad(tmp, 7), {}),
    "hellaswag": (lambda tmp: _hellaswag(tmp, 6), {}),
    # 200 tokens: 6 windows of 33
    "nanogpt": (lambda tmp: _nanogpt(tmp, 200), {}),
    "text": (lambda tmp: {"source": "embedded", "seq_length": 32, "max_bytes": 1024, "max_rows": 5}, {}),
    # 6 documents of 31 bytes: 5 samples of 33 tokens
    "megatron": (lambda tmp: _megatron(tmp, 6), {}),
}


def _config(tmp: Path, dataset: dict[str, Any], *, gbs: int = GBS, **sections: Any) -> Path:
    steps = {"global_batch_size": gbs, "local_batch_size": 2, "max_steps": 1, "val_every_steps": None}
    cfg = tiny_config(str(tmp / "run"), validation_dataset=None, step_scheduler=steps, **sections)
    cfg["dataset"] = dataset
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _rank_rows(config: Path) -> int:
    """The rows the ranks train on: `len()` of the dataset their builder gives (max_packs applied)."""
    cfg = load_config(str(config))
    ds = build_packed_dataset(
        cfg.dataset,
        ByteTokenizer(),
        packed_sequence_size=cfg.packed_sequence.packed_sequence_size,
        seed=cfg.seed,
    )
    limit = cfg.packed_sequence.max_packs
    return len(ds) if limit is None else min(len(ds), limit)


def _one_error_line(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("case", list(CASES))
def test_too_few_rows_is_refused_by_validate(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    dataset, sections = CASES[case]
    config = _config(tmp_path, dataset(tmp_path), **sections)
    assert run_cli(["validate", str(config), "--world-size=2"]) == 2
    line = _one_error_line(capsys)
    rows = _rank_rows(config)
    assert 0 < rows < GBS
    assert line == (
        f"error: step_scheduler.global_batch_size={GBS}: the dataset has {rows} rows, "
        f"fewer than global_batch_size={GBS}"
    )


@pytest.mark.parametrize("case", ["sft_rows", "sft_packed", "megatron"])
def test_too_few_rows_is_refused_by_train_before_any_rank_starts(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`recipes train --nproc-per-node=2` refuses in the launcher: torchrun is never called and
    nothing is written (no output_dir, so no rank log)."""
    import automodel.recipes.launch as launch

    def no_ranks(*args: Any, **kwargs: Any) -> int:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launch, "launch_torchrun", no_ranks)
    dataset, sections = CASES[case]
    config = _config(tmp_path, dataset(tmp_path), **sections)
    assert run_cli(["train", str(config), "--nproc-per-node=2"]) == 2
    line = _one_error_line(capsys)
    assert not (tmp_path / "run").exists()  # nor a Megatron order cached there: none was built
    rows = _rank_rows(config)
    assert line.startswith(f"error: step_scheduler.global_batch_size={GBS}: the dataset has {rows} rows")


def _packed_examples_for(rows: int, tmp: Path) -> int:
    """The number of arithmetic examples whose packing into 64-token rows gives exactly `rows`."""
    for n in range(1, 200):
        config = _config(tmp, _sft(tmp, n), packed_sequence={"packed_sequence_size": 64})
        if _rank_rows(config) == rows:
            return n
    raise AssertionError(f"no example count packs into {rows} rows")


@pytest.mark.parametrize("packed", [False, True])
def test_exactly_global_batch_size_rows_trains(
    packed: bool, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The boundary: ``global_batch_size`` rows train one step; one row fewer is refused."""
    sections: dict[str, Any] = {"packed_sequence": {"packed_sequence_size": 64}} if packed else {}
    n = _packed_examples_for(GBS, tmp_path) if packed else GBS
    config = _config(tmp_path, _sft(tmp_path, n), **sections)
    assert _rank_rows(config) == GBS
    assert run_cli(["validate", str(config)]) == 0, capsys.readouterr().err
    assert run_cli(["train", str(config)]) == 0, capsys.readouterr().err
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in records] == [1]
    capsys.readouterr()  # the run's own lines
    fewer = _config(tmp_path, _sft(tmp_path, n), gbs=GBS + 2, **sections)  # gbs: a multiple of lbs=2
    assert run_cli(["validate", str(fewer)]) == 2
    assert f"the dataset has {GBS} rows, fewer than global_batch_size={GBS + 2}" in _one_error_line(capsys)


@pytest.mark.parametrize("packed", [0, 64])
@pytest.mark.parametrize("examples", [1, 7, 8, 9, 40])
def test_count_is_the_builders_length(packed: int, examples: int, tmp_path: Path) -> None:
    """`count_rows` gives `len()` of the dataset the ranks build, or `at_least` when it has more."""
    section = load_config(
        str(_config(tmp_path, _sft(tmp_path, examples), packed_sequence={"packed_sequence_size": packed}))
    ).dataset
    rows = len(build_packed_dataset(section, ByteTokenizer(), packed_sequence_size=packed))
    for at_least in (1, 2, rows, rows + 1, 100):
        got = count_rows(section, ByteTokenizer(), packed_sequence_size=packed, seed=0, at_least=at_least)
        assert got == min(rows, at_least)


@pytest.mark.parametrize(("max_bytes", "max_rows"), [(1024, None), (1024, 5), (40000, None)])
def test_text_count_is_the_builders_length(max_bytes: int, max_rows: int | None, tmp_path: Path) -> None:
    text = {"source": "embedded", "seq_length": 32, "max_bytes": max_bytes, "max_rows": max_rows}
    section = load_config(str(_config(tmp_path, text))).dataset
    rows = len(build_packed_dataset(section, ByteTokenizer(), packed_sequence_size=0))
    for at_least in (1, rows, rows + 1):
        got = count_rows(section, ByteTokenizer(), packed_sequence_size=0, seed=0, at_least=at_least)
        assert got == min(rows, at_least)


def test_validation_split_without_an_example_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The validation split is evaluated whatever its size, but one without a usable example was
    its builder's refusal in the ranks: its first row is counted before launch too."""
    empty = tmp_path / "val.jsonl"
    empty.write_text("".join(json.dumps({"q": f"{i}+0=", "a": ""}) + "\n" for i in range(4)))
    config = _config(tmp_path, _sft(tmp_path, 16))
    raw = yaml.safe_load(config.read_text())
    raw["validation_dataset"] = {**raw["dataset"], "path_or_dataset_id": str(empty)}
    raw["step_scheduler"]["val_every_steps"] = 1
    config.write_text(yaml.safe_dump(raw))
    assert run_cli(["validate", str(config)]) == 2
    line = _one_error_line(capsys)
    assert line == (
        f"error: validation_dataset.path_or_dataset_id={str(empty)!r}: yields no usable example (4 empty answer)"
    )


def test_validate_says_when_the_rows_are_not_on_this_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`recipes validate` plans for machines it may not run on: data missing here is a line, not a refusal."""
    dataset = {**_sft(tmp_path, 5), "path_or_dataset_id": str(tmp_path / "elsewhere.jsonl")}
    assert run_cli(["validate", str(_config(tmp_path, dataset))]) == 0
    out = capsys.readouterr().out
    assert "rows not counted: the data is not on this machine (dataset.path_or_dataset_id=" in out
    raw = yaml.safe_load(_config(tmp_path, _sft(tmp_path, 5)).read_text())
    raw["tokenizer"] = {"path": str(tmp_path / "cluster_tokenizer")}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    assert run_cli(["validate", str(tmp_path / "cfg.yaml")]) == 0
    out = capsys.readouterr().out
    assert (
        f"rows not counted: tokenizer.path={str(tmp_path / 'cluster_tokenizer')!r} holds no tokenizer" in out
    )


def test_resume_under_another_global_batch_size_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The saved position counts global batches of 8: resuming under 4 is refused by the launcher
    (the sampler's rule, read from the checkpoint's rank-0 entry); under 8 it resumes."""
    import automodel.recipes.launch as launch

    config = _config(tmp_path, _sft(tmp_path, 32), checkpoint={"enabled": True, "save_consolidated": False})
    assert run_cli(["train", str(config)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    started: list[Any] = []
    monkeypatch.setattr(launch, "launch_torchrun", lambda *a, **k: started.append(a) or 0)
    more = ["--resume-with-changes", "--step_scheduler.max_steps=2"]
    argv = ["train", str(config), "--nproc-per-node=2", *more, "--step_scheduler.global_batch_size=4"]
    assert run_cli(argv) == 2
    step = tmp_path / "run" / "checkpoints" / "step_1"
    assert _one_error_line(capsys) == (
        f"error: step_scheduler.global_batch_size=4: resuming from {step}: sampler state is for "
        "global_batch_size=8, this loader's is 4: the same position would name other samples"
    )
    assert not started
    assert run_cli(["train", str(config), "--nproc-per-node=2", *more]) == 0  # the same size: launched
    assert len(started) == 1


def test_a_tokenizer_with_remote_code_is_counted_in_the_ranks(tmp_path: Path) -> None:
    """Its code runs only in the ranks: the launcher counts nothing and says so in one line."""
    from automodel.recipes.data.row_counts import check_row_counts

    raw = yaml.safe_load(_config(tmp_path, _sft(tmp_path, 5)).read_text())
    raw["tokenizer"] = {"trust_remote_code": True}
    assert check_row_counts(load_config(raw)) == (
        "note: the dataset's rows are counted in the ranks (tokenizer.trust_remote_code: the tokenizer's "
        f"own code runs only there); fewer rows than step_scheduler.global_batch_size={GBS} is refused there"
    )


def test_a_stream_is_not_counted_and_says_so(tmp_path: Path) -> None:
    """A stream has no length (its run is max_steps long): nothing is counted, one start-up line."""
    from automodel.recipes.data.row_counts import check_row_counts

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(4)))
    stream = {"source": "streaming", "path": str(tmp_path / "docs.jsonl"), "seq_length": 16}
    note = check_row_counts(load_config(str(_config(tmp_path, stream))))
    assert note == (
        "note: dataset (source: streaming) is not counted before launch: a stream has no length; a dp "
        "rank whose share of it holds no document is refused in the ranks"
    )


def _short_validation_split(tmp_path: Path) -> dict[str, Any]:
    """A config whose validation split (text shorter than one row) gives no row."""
    (tmp_path / "val.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    raw = yaml.safe_load(_config(tmp_path, _sft(tmp_path, 16)).read_text())
    raw["validation_dataset"] = {"source": "json", "path": str(tmp_path / "val.jsonl"), "seq_length": 32}
    raw["step_scheduler"]["val_every_steps"] = 1
    return raw


def test_validation_split_without_a_row_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A text split shorter than one row gave a validation loss of 0/0 (``val_loss: null``) without
    a word: refused before launch, naming the file."""
    raw = _short_validation_split(tmp_path)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(raw))
    assert run_cli(["validate", str(tmp_path / "cfg.yaml")]) == 2
    assert _one_error_line(capsys) == (
        f"error: validation_dataset.path={str(tmp_path / 'val.jsonl')!r}: gives no row to evaluate (fewer "
        "tokens than one row): its validation loss would be 0/0"
    )


def _build_on_rank(raw: dict[str, Any]) -> str:
    """Rank function: build the run (no training); the `ConfigError` it raises, as its one line."""
    from automodel.recipes.trainer import Trainer

    try:
        Trainer(load_config(raw)).build()
    except ConfigError as e:
        return str(e)
    return "built"


def test_validation_split_without_a_row_is_refused_in_the_ranks(tmp_path: Path) -> None:
    """Rows counted only in the ranks (a tokenizer whose own code runs only there): a split without
    a row ended with ``val_loss: null``; the ranks refuse it with the pre-launch message (one rule,
    `row_counts.check_rows_to_evaluate`)."""
    raw = _short_validation_split(tmp_path)
    raw["tokenizer"] = {"trust_remote_code": True}
    from automodel.recipes.data.row_counts import check_row_counts

    assert check_row_counts(load_config(raw)) is not None  # not counted before launch: the ranks' check
    (got,) = run_on_ranks(_build_on_rank, world_size=1, args=(raw,), timeout_s=300)
    assert got == (
        f"validation_dataset.path={str(tmp_path / 'val.jsonl')!r}: gives no row to evaluate (fewer "
        "tokens than one row): its validation loss would be 0/0"
    )
