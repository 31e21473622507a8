"""The data trained on is the data given, or the run says otherwise in one line (issue 43's data
findings): no default cut, rows without their text, damaged corpus headers, token ids beyond the
model's vocab_size, and the end of the data before max_steps. The CLI cases: test_faults_data.py."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from automodel.data.batches import read_batch
from automodel.data.megatron_writer import MegatronWriter
from automodel.data.nanogpt_shard import LEGACY_MAGIC, NanogptShard, write_nanogpt_shard
from automodel.data.pretrain_build import (
    build_megatron,
    build_nanogpt,
    check_megatron_paths,
    check_nanogpt_paths,
)
from automodel.data.pretrain_sections import MegatronPretrainingSection, NanogptSection
from automodel.data.run_length import data_end_line
from automodel.data.text_rows import check_text_keys
from automodel.data.text_sections import DatasetSection
from automodel.data.token_ids import (
    SAMPLE_TOKENS,
    TokenIdError,
    check_corpus_ids,
    check_tokenizer_ids,
)
from automodel.data.tokenizer import ByteTokenizer, build_tokenizer
from automodel.recipes.config.sections import StepSchedulerSection
from automodel.recipes.data.kinds import build_packed_dataset
from automodel.recipes.data.launch_data import check_data_fits_model
from automodel.recipes.errors import ConfigError, DataError

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import SPARSE_TOKENIZER_BIG_ID, tiny_config, write_sparse_tokenizer  # noqa: E402


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- no default cut ------------------------------------------------------------------------------
def test_a_corpus_over_2m_characters_is_read_whole_and_a_set_max_bytes_says_what_it_left(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    docs = [f"{i:05d} " + "x" * 9993 + "\n" for i in range(220)]  # 2,200,000 characters
    path = _jsonl(tmp_path / "big.jsonl", [{"text": d} for d in docs])
    assert DatasetSection().max_bytes is None
    ds = build_packed_dataset(
        DatasetSection(source="json", path=str(path), seq_length=1023),
        ByteTokenizer(),
        packed_sequence_size=0,
    )
    assert len(ds) == (2_200_000 + 220) // 1024  # every character and one EOS per document
    assert "max_bytes" not in capsys.readouterr().err
    cut = build_packed_dataset(
        DatasetSection(source="json", path=str(path), seq_length=1023, max_bytes=1_000_000),
        ByteTokenizer(),
        packed_sequence_size=0,
    )
    assert len(cut) == (1_000_000 + 100) // 1024
    assert capsys.readouterr().err.splitlines()[-1] == (
        "dataset: dataset.max_bytes=1000000 read 1,000,000 of 2,200,000 characters (100 of 220 "
        "documents); unset it to train on all of dataset.path"
    )


# ---- rows without their text ---------------------------------------------------------------------
def test_a_row_without_the_text_key_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", [{"text": "first"}, {"body": "no text key"}, {"text": "third"}])
    section = DatasetSection(source="json", path=str(path), seq_length=4)
    want = f"{path}:2: the row has no 'text' key (dataset.text_key); under dataset.bad_rows: skip"
    with pytest.raises(DataError) as before_launch:
        check_text_keys(section)
    assert str(before_launch.value).startswith(want)
    with pytest.raises(DataError) as in_rank:  # the ranks read what `datasets` gives: a null
        build_packed_dataset(section, ByteTokenizer(), packed_sequence_size=0)
    assert str(in_rank.value) == str(before_launch.value)
    nulls = _jsonl(tmp_path / "n.jsonl", [{"text": "first"}, {"text": None}])
    with pytest.raises(DataError, match=r"n\.jsonl:2: the row has null 'text'"):
        check_text_keys(DatasetSection(source="json", path=str(nulls), seq_length=4))
    table = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["a", None, "b"]}), table)
    with pytest.raises(DataError, match=r"d\.parquet:2: the row has null 'text'"):
        check_text_keys(DatasetSection(source="parquet", path=str(table), seq_length=4))


def test_skip_counts_a_missing_key_as_missing_key_and_a_null_as_null_value(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    rows = [{"text": "first document"}, {"body": "x"}, {"text": None}, {"text": "last one"}, {"b": 1}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    section = DatasetSection(source="json", path=str(path), seq_length=4, bad_rows="skip")
    check_text_keys(section)  # skip: counted in the ranks, not refused
    ds = build_packed_dataset(section, ByteTokenizer(), packed_sequence_size=0)
    assert capsys.readouterr().err == "dataset: 2 rows read; skipped 3 of 5 (2 missing_key, 1 null_value)\n"
    assert len(ds) == (len("first document") + len("last one") + 2) // 5


# ---- corpus headers ------------------------------------------------------------------------------
def test_a_nanogpt_header_with_a_damaged_magic_is_refused_not_read_as_tokens(tmp_path: Path) -> None:
    path = tmp_path / "shard.bin"
    write_nanogpt_shard(path, np.arange(1, 2001) % 200)
    raw = bytearray(path.read_bytes())
    raw[:4] = struct.pack("<i", LEGACY_MAGIC + 1)
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError) as e:
        check_nanogpt_paths(NanogptSection(file_pattern=str(path)))
    assert str(e.value) == (
        f"dataset.file_pattern='{path}': has a nanoGPT header (2000 tokens, version 1, matching its 5024 "
        f"bytes) with magic {LEGACY_MAGIC + 1}, not 20240520 (modded-nanogpt) or 278895051 (NeMo "
        "AutoModel): a damaged header; rewrite the shard"
    )
    raw[:4] = struct.pack("<i", LEGACY_MAGIC)
    raw[4:8] = struct.pack("<i", 2)  # version
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match="has nanoGPT header version 2; only 1 is read"):
        check_nanogpt_paths(NanogptSection(file_pattern=str(path)))
    raw[4:8] = struct.pack("<i", 1)
    path.write_bytes(bytes(raw[:-2]))  # one token short of the header's count
    with pytest.raises(ConfigError, match="is truncated: 5022 bytes, its header announces 2000 tokens"):
        check_nanogpt_paths(NanogptSection(file_pattern=str(path)))
    flat = tmp_path / "flat.bin"  # nanoGPT's prepare.py: headerless uint16, still read as such
    flat.write_bytes((np.arange(3000) % 250).astype("<u2").tobytes())
    assert NanogptShard(flat).tokens(0, 3000).tolist() == (np.arange(3000) % 250).tolist()


def _megatron_core_corpus(prefix: Path, docs: list[list[int]], dtype: type = np.uint16) -> str:
    """A corpus written by megatron-core's own builder."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype)
    for d in docs:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.mark.parametrize(
    ("offset", "value", "why"),
    [
        (0, b"MMIDIDY", "is not a Megatron .idx file (no MMIDIDX header)"),
        (9, struct.pack("<Q", 2), "has index version 2; only version 1 is read"),
        (17, bytes([6]), "has token dtype code 6, not an integer token type"),
        (17, bytes([42]), "has token dtype code 42, not an integer token type"),
    ],
)
def test_a_damaged_megatron_index_is_refused_naming_the_file(
    tmp_path: Path, offset: int, value: bytes, why: str
) -> None:
    prefix = _megatron_core_corpus(tmp_path / "c", [[1, 2, 3, 0]] * 20)
    idx = Path(prefix + ".idx")
    raw = bytearray(idx.read_bytes())
    raw[offset : offset + len(value)] = value
    idx.write_bytes(bytes(raw))
    with pytest.raises(ConfigError) as e:
        check_megatron_paths(MegatronPretrainingSection(paths=prefix, split="1,0,0"))
    assert str(e.value) == f"dataset.paths='{idx}': {why}"


def test_a_megatron_bin_of_another_size_than_its_index_is_refused(tmp_path: Path) -> None:
    prefix = _megatron_core_corpus(tmp_path / "c", [[1, 2, 3, 0]] * 20)
    bin_path = Path(prefix + ".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"c\.bin'?: is truncated: 158 bytes, its index c\.idx needs 160"):
        check_megatron_paths(MegatronPretrainingSection(paths=prefix, split="1,0,0"))
    bin_path.write_bytes(bin_path.read_bytes() + b"\0\0\0\0")
    with pytest.raises(
        ConfigError, match=r"does not match .*c\.idx: the index covers bytes 0\.\.160, the file"
    ):
        check_megatron_paths(MegatronPretrainingSection(paths=prefix, split="1,0,0"))


# ---- token ids against vocab_size ----------------------------------------------------------------
def test_corpus_ids_beyond_vocab_size_are_refused_before_launch_naming_file_token_and_id(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 1000, 50).tolist() + [0] for _ in range(40)]  # uint16 ids up to 999
    prefix = _megatron_core_corpus(tmp_path / "wide", docs)
    first = next(i for i, t in enumerate(t for d in docs for t in d) if t >= 256)
    with pytest.raises(TokenIdError) as e:
        check_corpus_ids(MegatronPretrainingSection(paths=prefix, split="1,0,0"), vocab_size=256)
    flat = [t for d in docs for t in d]
    assert str(e.value) == (
        f"{prefix}.bin: token {first} is id {flat[first]}, outside the model's vocab_size 256 (ids 0..255): "
        "the file was written with another tokenizer, or is damaged"
    )
    check_corpus_ids(MegatronPretrainingSection(paths=prefix, split="1,0,0"), vocab_size=1000)
    shard = tmp_path / "s.bin"
    write_nanogpt_shard(shard, np.array(flat))
    with pytest.raises(TokenIdError, match=rf"s\.bin: token {first} is id {flat[first]}, outside"):
        check_corpus_ids(NanogptSection(file_pattern=str(shard)), vocab_size=256)
    # uint8 ids cannot reach 256: nothing is read (a file of random bytes passes unread)
    small = tmp_path / "small"
    w = MegatronWriter(small, dtype=np.uint8)
    w.add_document(list(range(256)))
    w.finalize()
    check_corpus_ids(MegatronPretrainingSection(paths=str(small), split="1,0,0"), vocab_size=256)


def _corpus_with_one_bad_id(prefix: Path, *, at: int, total: int) -> tuple[str, list[int]]:
    """uint16 byte-range ids with one id 999 at token `at`, past the sampled ends."""
    rng = np.random.default_rng(1)
    flat = rng.integers(1, 256, total).tolist()
    flat[at] = 999
    w = MegatronWriter(prefix, dtype=np.uint16)
    for i in range(0, total, 100):
        w.add_document(flat[i : i + 100])
    w.finalize()
    return str(prefix), flat


class _Tok:
    vocab_size, eos_token_id = 256, 0


def test_a_bad_id_between_the_sampled_ends_stops_its_batch_naming_file_and_token(tmp_path: Path) -> None:
    total, at = 4 * SAMPLE_TOKENS, 2 * SAMPLE_TOKENS + 17
    prefix, flat = _corpus_with_one_bad_id(tmp_path / "c", at=at, total=total)
    section = MegatronPretrainingSection(paths=prefix, split="1,0,0", seq_length=64)
    check_corpus_ids(section, vocab_size=256)  # the sample reads the two ends only
    ds = build_megatron(section, _Tok(), packed_sequence_size=0, seed=0)
    hit = next(i for i in range(len(ds)) if 999 in ds.sample(i).tolist())
    read_batch(ds, [0, 1], vocab_size=256)  # a clean batch passes
    with pytest.raises(TokenIdError) as e:
        read_batch(ds, [0, hit], vocab_size=256)
    assert str(e.value) == (
        f"{prefix}.bin: token {at} (sample {hit}) is id 999, outside the model's vocab_size 256 "
        "(ids 0..255): the data was written with another tokenizer, or is damaged"
    )
    shard = tmp_path / "s.bin"
    write_nanogpt_shard(shard, np.array(flat))
    windows = build_nanogpt(
        NanogptSection(file_pattern=str(shard), seq_len=64), _Tok(), packed_sequence_size=0, seed=0
    )
    with pytest.raises(TokenIdError, match=rf"s\.bin: token {at} \(sample {at // 65}\) is id 999"):
        read_batch(windows, [at // 65], vocab_size=256)


def test_a_tokenizer_yielding_an_id_beyond_vocab_size_is_refused_before_launch(tmp_path: Path) -> None:
    write_sparse_tokenizer(tmp_path / "tok")
    built = build_tokenizer(str(tmp_path / "tok"))
    assert SPARSE_TOKENIZER_BIG_ID in built.encode("a z") and built.vocab_size < 256  # len() misses it
    cfg = tiny_config(str(tmp_path / "run"), tokenizer={"path": str(tmp_path / "tok")})
    from automodel.recipes import load_config

    with pytest.raises(ConfigError) as e:
        check_data_fits_model(load_config(cfg))
    assert str(e.value) == (
        f"tokenizer.path='{tmp_path / 'tok'}': the tokenizer yields id 2000000000 ('z'), outside the "
        "model's vocab_size 256 (ids 0..255) (model.config.vocab_size); use the model's own tokenizer "
        "or a model with a larger vocab_size"
    )
    check_tokenizer_ids(ByteTokenizer(), vocab_size=256, path=None, vocab_key="model.config.vocab_size")
    with pytest.raises(ConfigError, match=r"^model\.config\.vocab_size=200: the tokenizer yields id 255"):
        check_tokenizer_ids(ByteTokenizer(), vocab_size=200, path=None, vocab_key="model.config.vocab_size")


# ---- the end of the data -------------------------------------------------------------------------
def test_the_end_of_the_data_before_max_steps_is_one_line() -> None:
    ss = StepSchedulerSection(max_steps=500)
    assert data_end_line(step=26, steps_per_epoch=26, section=ss) == (
        "step_scheduler: the data ended at step 26 of step_scheduler.max_steps=500: 1 epoch(s) of 26 "
        "steps (step_scheduler.num_epochs=1); set step_scheduler.num_epochs=20 to reach max_steps"
    )
    assert (
        data_end_line(
            step=500, steps_per_epoch=26, section=StepSchedulerSection(max_steps=500, num_epochs=20)
        )
        is None
    )
    assert data_end_line(step=12, steps_per_epoch=26, section=ss) is None  # pre-empted, not the data
    assert data_end_line(step=26, steps_per_epoch=26, section=StepSchedulerSection()) is None
