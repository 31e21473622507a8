"""``bad_rows: skip`` on CSV, Parquet, plain-text files and dataset folders (Hub snapshots), with real
small files written here: each bad row is left out and counted under its reason, the rows kept are
exactly those of the good rows alone, and what cannot be skipped row by row (a Parquet column of the
wrong type, a column a file lacks) is refused naming the key, the file and the column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from automodel.data.text_sections import DatasetSection, SFTDatasetSection
from automodel.recipes.config.sections import build_section
from automodel.recipes.data import ByteTokenizer, build_packed_dataset
from automodel.recipes.data.kinds import check_rows
from automodel.recipes.errors import ConfigError

KW = {"source": "instruction", "column_mapping": {"question": "q", "answer": "a"}, "seq_length": 16}
GOOD = [("1+1=", "2"), ("3+3=", "6"), ("2+5=", "7")]


def _sft(path: Path | str, **kw: object) -> SFTDatasetSection:
    return build_section(SFTDatasetSection, {**KW, "path_or_dataset_id": str(path), **kw})


def _same_rows(ds: Any, ref: Any) -> None:
    assert len(ds) == len(ref)
    rows = list(range(len(ref)))
    for a, b in zip(ds.batch(rows), ref.batch(rows), strict=True):
        assert torch.equal(a, b)


def _clean_jsonl(tmp_path: Path) -> Path:
    import json

    path = tmp_path / "clean.jsonl"
    path.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in GOOD))
    return path


def test_csv_bad_rows_are_skipped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "d.csv"
    path.write_bytes(
        b"q,a\n"
        b"1+1=,2\n"
        b"caf\xe9,x\n"  # not UTF-8
        b'3+3=,6\n"a",b,c\n'  # three fields under a two-column header
        b'"2+5=","7"\n'
    )
    section = _sft(path, bad_rows="skip")
    check_rows(section)
    ds = build_packed_dataset(section, ByteTokenizer(), packed_sequence_size=0)
    assert ds.stats["skipped"] == {"encoding": 1, "malformed_csv": 1} and ds.stats["records"] == 5
    assert "skipped 2 of 5 (1 encoding, 1 malformed_csv)" in capsys.readouterr().err
    _same_rows(
        ds, build_packed_dataset(_sft(_clean_jsonl(tmp_path)), ByteTokenizer(), packed_sequence_size=0)
    )
    from automodel.recipes.errors import DataError

    with pytest.raises(DataError, match=r"d\.csv:3: not UTF-8"):  # error: the first bad row, named
        build_packed_dataset(_sft(path), ByteTokenizer(), packed_sequence_size=0)


def test_parquet_null_values_are_counted_and_a_wrong_column_type_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    qs, answers = [q for q, _ in GOOD], [a for _, a in GOOD]
    pq.write_table(
        pa.table({"q": [qs[0], qs[1], None, qs[2]], "a": [answers[0], answers[1], "9", answers[2]]}), path
    )
    ds = build_packed_dataset(_sft(path, bad_rows="skip"), ByteTokenizer(), packed_sequence_size=0)
    assert ds.stats["skipped"] == {"empty prompt": 1} and ds.stats["records"] == 4  # the null question
    _same_rows(
        ds, build_packed_dataset(_sft(_clean_jsonl(tmp_path)), ByteTokenizer(), packed_sequence_size=0)
    )

    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"q": qs, "a": [2, 6, 7]}), ints)
    says = r"dataset.path_or_dataset_id=.*ints.parquet.: column 'a' holds int64, not text: a Parquet column"
    with pytest.raises(ConfigError, match=says):
        check_rows(_sft(ints, bad_rows="skip"))  # before launch
    lacking = tmp_path / "lacking.parquet"
    pq.write_table(pa.table({"q": qs}), lacking)
    with pytest.raises(ConfigError, match=r"lacking.parquet.: has no column 'a' \(its columns: q\)"):
        build_packed_dataset(_sft(lacking, bad_rows="skip"), ByteTokenizer(), packed_sequence_size=0)


def test_dataset_folder_of_a_hub_snapshot_is_read_row_by_row(tmp_path: Path) -> None:
    """A folder laid out like a Hub snapshot (data/<split>-*.csv): the split's files, rows skipped."""
    folder = tmp_path / "snapshot"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train-00000-of-00001.csv").write_bytes(b"q,a\n1+1=,2\n3+3=,6,extra\n3+3=,6\n2+5=,7\n")
    (folder / "data" / "validation-00000-of-00001.csv").write_bytes(b"q,a\n9+9=,18\n")
    ds = build_packed_dataset(_sft(folder, bad_rows="skip"), ByteTokenizer(), packed_sequence_size=0)
    assert ds.stats["skipped"] == {"malformed_csv": 1} and ds.stats["records"] == 4
    _same_rows(
        ds, build_packed_dataset(_sft(_clean_jsonl(tmp_path)), ByteTokenizer(), packed_sequence_size=0)
    )
    with pytest.raises(ConfigError, match="has no data files for split 'test'"):
        build_packed_dataset(
            _sft(folder, bad_rows="skip", split="test"), ByteTokenizer(), packed_sequence_size=0
        )


def test_chat_template_refusal_is_counted_under_skip(tmp_path: Path) -> None:
    """A template that refuses a row (roles not alternating) skips it in a Parquet file too."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _sft_helpers import save_chat_tokenizer
    from test_sft import ALTERNATING

    from automodel.recipes.data import build_tokenizer

    save_chat_tokenizer(tmp_path / "tok", chat_template=ALTERNATING)
    tok = build_tokenizer(str(tmp_path / "tok"))
    good = [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]
    twice = [
        {"role": "user", "content": "say"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hi"},
    ]
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"messages": [good, twice, good]}), path)
    section = build_section(
        SFTDatasetSection,
        {"source": "chat", "path_or_dataset_id": str(path), "seq_length": 12, "bad_rows": "skip"},
    )
    ds = build_packed_dataset(section, tok, packed_sequence_size=0)
    assert len(ds) == 2
    assert list(ds.stats["skipped"]) == [
        "refused by the chat template (Conversation roles must alternate user/assistant/user/assistant)"
    ]


def test_pretraining_parquet_and_text_sources_skip_bad_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    texts = ["the first document", "a second one", "and a third"]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"body": [texts[0], None, texts[1], texts[2]]}), path)
    kw = {"text_key": "body", "seq_length": 8}
    ds = build_packed_dataset(
        DatasetSection(source="parquet", path=str(path), bad_rows="skip", **kw),
        ByteTokenizer(),
        packed_sequence_size=0,
    )
    assert "dataset: 3 rows read; skipped 1 of 4 (1 null_value)" in capsys.readouterr().err
    clean = tmp_path / "clean.parquet"
    pq.write_table(pa.table({"body": texts}), clean)
    ref = build_packed_dataset(
        DatasetSection(source="parquet", path=str(clean), **kw), ByteTokenizer(), packed_sequence_size=0
    )
    _same_rows(ds, ref)

    lines = tmp_path / "d.txt"
    lines.write_bytes(b"the first document\ncaf\xe9 au lait\na second one\nand a third\n")
    ds = build_packed_dataset(
        DatasetSection(source="text", path=str(lines), bad_rows="skip", seq_length=8),
        ByteTokenizer(),
        packed_sequence_size=0,
    )
    assert "dataset: 3 rows read; skipped 1 of 4 (1 encoding)" in capsys.readouterr().err
    clean_txt = tmp_path / "clean.txt"
    clean_txt.write_text("\n".join(texts) + "\n")
    _same_rows(
        ds,
        build_packed_dataset(
            DatasetSection(source="text", path=str(clean_txt), seq_length=8),
            ByteTokenizer(),
            packed_sequence_size=0,
        ),
    )

    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"body": [1, 2]}), ints)
    with pytest.raises(
        ConfigError, match="dataset.path=.*ints.parquet.: column 'body' holds int64, not text"
    ):
        check_rows(DatasetSection(source="parquet", path=str(ints), bad_rows="skip", **kw))
    with pytest.raises(
        ConfigError, match="dataset.bad_rows='skip': applies to the json, text, parquet sources, not embedded"
    ):
        DatasetSection(source="embedded", bad_rows="skip")


def test_csv_reads_the_same_under_error_and_skip(tmp_path: Path) -> None:
    """Digits and "NA" stay text in both modes (pandas would make them an int column and a null)."""
    path = tmp_path / "d.csv"
    path.write_text('q,a\n1+1=,2\nNA,4\n"2+5=","7"\n')
    strict, skip = _sft(path), _sft(path, bad_rows="skip")
    check_rows(strict)
    ds = build_packed_dataset(strict, ByteTokenizer(), packed_sequence_size=0)
    assert ds.stats["records"] == 3
    _same_rows(ds, build_packed_dataset(skip, ByteTokenizer(), packed_sequence_size=0))


def test_csv_bad_row_under_error_names_file_and_line_before_launch(tmp_path: Path) -> None:
    from automodel.recipes.errors import DataError

    path = tmp_path / "d.csv"
    path.write_text('q,a\n1+1=,2\n"a",b,c\n3+3=,6\n')
    with pytest.raises(DataError, match=r"d\.csv:3: 3 fields where the header has 2"):
        check_rows(_sft(path))
    with pytest.raises(DataError, match=r"d\.csv:3: "):
        build_packed_dataset(_sft(path), ByteTokenizer(), packed_sequence_size=0)
