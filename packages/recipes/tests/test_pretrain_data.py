"""Memory-mapped pretraining data: Megatron .bin/.idx (checked against megatron-core both ways),
nanoGPT shards, windows, splits, blends, sample order and resume, and errors naming the file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import numpy as np
import pytest
import torch

from automodel.data.batches import build_sampler
from automodel.data.megatron_corpus import MegatronCorpus
from automodel.data.megatron_writer import MegatronWriter, token_dtype_for_vocab
from automodel.data.nanogpt_shard import MAGIC, write_nanogpt_shard
from automodel.data.pretrain_build import build_megatron, build_nanogpt
from automodel.data.pretrain_sections import (
    MegatronPretrainingSection,
    MegatronPretrainingValidationSection,
    NanogptSection,
)
from automodel.data.sample_order import permute
from automodel.recipes.data.kinds import parse_section
from automodel.recipes.errors import ConfigError


class Tok:
    """What the builders use of a tokenizer."""

    def __init__(self, vocab_size: int = 512, eos: int = 0) -> None:
        self.vocab_size, self.eos_token_id = vocab_size, eos


def random_docs(n: int, *, seed: int = 0, lo: int = 5, hi: int = 40, vocab: int = 500) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, int(rng.integers(lo, hi))).tolist() + [0] for _ in range(n)]


def write_corpus(prefix: Path, docs: list[list[int]], dtype: type = np.uint16) -> str:
    w = MegatronWriter(prefix, dtype=dtype)
    for d in docs:
        w.add_document(d)
    w.finalize()
    return str(prefix)


def megatron(paths, **kw) -> MegatronPretrainingSection:
    return MegatronPretrainingSection(paths=paths, **kw)


# ---- format, both ways against megatron-core ------------------------------------------------------
def test_our_corpus_reads_in_megatron_core(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = random_docs(30)
    prefix = write_corpus(tmp_path / "ours", docs)
    theirs = cast(Any, IndexedDataset(prefix))  # megatron-core's annotations are looser than its values
    assert len(theirs) == len(docs)
    assert [theirs[i].tolist() for i in range(len(docs))] == docs
    assert theirs.index.dtype == np.uint16
    assert theirs.document_indices.tolist() == list(range(len(docs) + 1))


def test_megatron_core_corpus_reads_here(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    docs = random_docs(25, seed=1, vocab=70000)
    prefix = str(tmp_path / "theirs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for d in docs:
        builder.add_document(torch.tensor(d), [len(d)])
    builder.finalize(prefix + ".idx")
    corpus = MegatronCorpus(prefix)
    assert corpus.dtype == np.int32 and corpus.num_sequences == len(docs)
    assert [corpus.sequence(i).tolist() for i in range(len(docs))] == docs
    flat = [t for d in docs for t in d]
    assert corpus.tokens(0, corpus.num_tokens).tolist() == flat


# ---- windows ----------------------------------------------------------------------------------------
def test_windows_cross_documents_with_megatron_stride_and_reset_positions(tmp_path: Path) -> None:
    docs = random_docs(20, seed=3)
    prefix = write_corpus(tmp_path / "c", docs)
    ds = build_megatron(megatron(prefix, seq_length=8, split="1,0,0"), Tok(), packed_sequence_size=0, seed=0)
    # the documents concatenated in megatron-core's shuffled document order; sample k of it is a
    # window of 9 tokens at 8 * k, and position i reads window shuffle[i]
    stream = np.concatenate([docs[d] for d in ds.order.document_index])
    assert sorted(ds.order.document_index.tolist()) == list(range(20))
    assert len(ds) == (stream.size - 1) // 8
    for i in (0, 1, len(ds) - 1):
        k = int(ds.order.shuffle_index[i])
        assert ds.sample(i).tolist() == stream[k * 8 : k * 8 + 9].tolist()
    first = int(np.flatnonzero(ds.order.shuffle_index == 0)[0])
    ids, labels, pos = ds.batch([3, first])
    assert ids[1].tolist() == stream[:8].tolist() and labels[1].tolist() == stream[1:9].tolist()
    assert pos[0].tolist() == list(range(8))
    packed = build_megatron(
        megatron(prefix, seq_length=8, split="1,0,0"), Tok(), packed_sequence_size=64, seed=0
    )
    ids, _, pos = packed.batch([5])
    eos_at = [i for i, t in enumerate(ids[0].tolist()) if t == 0]
    assert eos_at, "the test window should hold a document end"
    for i, p in enumerate(pos[0].tolist()):
        last_start = max([0] + [e + 1 for e in eos_at if e < i])
        assert p == i - last_start


def test_nanogpt_shard_layouts_and_stride(tmp_path: Path) -> None:
    tokens = np.arange(1, 100, dtype=np.uint16)
    write_nanogpt_shard(tmp_path / "train_000.bin", tokens)  # modded-nanogpt: magic 20240520
    write_nanogpt_shard(tmp_path / "train_001.bin", tokens + 100, header=False)  # nanoGPT prepare.py
    section = NanogptSection(file_pattern=str(tmp_path / "train_*.bin"), seq_len=9)
    ds = build_nanogpt(section, Tok(vocab_size=50257), packed_sequence_size=0, seed=0)
    assert ds.span_sizes.tolist() == [99 // 10, 99 // 10]
    assert ds.sample(1).tolist() == list(range(11, 21))  # stride seq_len + 1, as modded-nanogpt
    assert ds.sample(9).tolist() == list(range(101, 111))
    assert ds.sample_order.indices(epoch=0, start=0, stop=4) == [0, 1, 2, 3]
    new = tmp_path / "wide_000.bin"  # NeMo's processor header: magic 278895051, 4-byte tokens
    head = np.zeros(256, dtype="<i4")
    head[:4] = (MAGIC, 1, 50, 4)
    new.write_bytes(head.tobytes() + (np.arange(50, dtype="<u4") + 70000).tobytes())
    wide = build_nanogpt(
        NanogptSection(file_pattern=str(new), seq_len=9),
        Tok(vocab_size=100000),
        packed_sequence_size=0,
        seed=0,
    )
    assert len(wide) == 5 and wide.sample(2).tolist() == list(range(70020, 70030))
    for i in range(3):
        write_nanogpt_shard(tmp_path / f"many_{i}.bin", tokens + 100 * i)
    shuffled = build_nanogpt(
        NanogptSection(file_pattern=str(tmp_path / "many_*.bin"), seq_len=9, shuffle_files=True),
        Tok(),
        packed_sequence_size=0,
        seed=0,
    )
    n = len(shuffled)
    orders = [shuffled.sample_order.indices(epoch=e, start=0, stop=n) for e in range(4)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert len({tuple(o) for o in orders}) > 1  # shard order changes with the epoch, in-shard order kept
    for o in orders:
        assert all(b == a + 1 for a, b in zip(o, o[1:]) if b not in (0, 9, 18))


def test_nanogpt_align_to_bos(tmp_path: Path) -> None:
    bos = 7
    docs = [[bos] + [1] * n for n in (3, 12, 2, 2, 20, 5)]
    write_nanogpt_shard(tmp_path / "s.bin", np.array([t for d in docs for t in d]))
    section = NanogptSection(
        file_pattern=str(tmp_path / "s.bin"), seq_len=4, align_to_bos=True, bos_token=bos
    )
    ds = build_nanogpt(section, Tok(), packed_sequence_size=0, seed=0)
    samples = [ds.sample(i).tolist() for i in range(len(ds))]
    assert all(s[0] == bos and len(s) == 5 for s in samples)
    # starts: 0, 4 (next BOS at/after 5: 17), 17, 20 (next at/after 22: 23) , 23, 44
    assert [ds.token_offset(i)[1] for i in range(len(ds))] == [0, 17, 23, 44]


# ---- order, dp slicing, resume ----------------------------------------------------------------------
def test_keyed_permutation_is_a_permutation_per_seed_and_epoch() -> None:
    for n in (1, 2, 7, 1000, 4097):
        p = permute(np.arange(n), n=n, seed=5, epoch=2)
        assert sorted(p.tolist()) == list(range(n))
    a, b = (permute(np.arange(100), n=100, seed=5, epoch=e).tolist() for e in (0, 1))
    assert a != b and a == permute(np.arange(100), n=100, seed=5, epoch=0).tolist()
    # one index at a time gives the same answer: nothing depends on what else was asked
    assert [int(permute(np.array([i]), n=100, seed=5, epoch=1)[0]) for i in range(100)] == b


def _global_steps(ds, *, dp: int, steps: int, state=None, gbs: int = 8, lbs: int = 1):
    samplers = [
        build_sampler(ds, global_batch_size=gbs, local_batch_size=lbs, dp_rank=r, dp_size=dp, seed=3)
        for r in range(dp)
    ]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    out = []
    for _ in range(steps):
        per_rank = [[i for mb in s.next_step() for i in mb] for s in samplers]
        flat = [i for r in per_rank for i in r]
        assert len(set(flat)) == len(flat), "two dp ranks read the same sample in one step"
        out.append(flat)
    return out, samplers[0].state_dict()


def test_dp2_to_dp4_resume_feeds_the_same_global_batches(tmp_path: Path) -> None:
    prefix = write_corpus(tmp_path / "c", random_docs(60))
    ds = build_megatron(megatron(prefix, seq_length=8, split="1,0,0"), Tok(), packed_sequence_size=0, seed=0)
    steps_per_epoch = len(ds) // 8
    straight, _ = _global_steps(ds, dp=1, steps=steps_per_epoch + 3)
    first, state = _global_steps(ds, dp=2, steps=5)
    second, _ = _global_steps(ds, dp=4, steps=steps_per_epoch - 2, state=state, lbs=2)
    assert first + second == straight
    epoch0 = [i for step in straight[:steps_per_epoch] for i in step]
    assert len(set(epoch0)) == len(epoch0)  # an epoch reads each sample at most once
    assert straight[steps_per_epoch] != straight[0]  # the next epoch is reshuffled
    # a sampler built fresh at (epoch, position) agrees: the order is a function of (seed, epoch)
    rows = [ds.batch([i])[0] for i in straight[2][:2]]
    assert not torch.equal(rows[0], rows[1])


# ---- config: NeMo AutoModel keys, the kind registry -----------------------------------------------
def test_automodel_megatron_section_parses(tmp_path: Path) -> None:
    prefix = write_corpus(tmp_path / "processed_data_0_text_document", random_docs(200))
    write_corpus(tmp_path / "processed_data_1_text_document", random_docs(200, seed=4))
    raw = {
        "_target_": "nemo_automodel.components.datasets.llm.megatron_dataset.MegatronPretraining",
        "paths": str(tmp_path / "processed_data_*_text_document*"),
        "index_mapping_dir": str(tmp_path / "mapping_dir"),
        "seq_length": 16,
        "split": "0.99, 0.01, 0.00",
        "splits_to_build": "validation",
        "num_val_samples": 1024,
    }
    section = parse_section(raw, validation=True)
    assert isinstance(section, MegatronPretrainingValidationSection)
    assert section.split_name == "validation" and section.seq_length == 16
    ds = build_megatron(section, Tok(), packed_sequence_size=0, seed=0)
    assert [p.name for p in ds.parts] == [prefix, str(tmp_path / "processed_data_1_text_document")]
    nano = parse_section(
        {"_target_": "x.NanogptDataset", "file_pattern": "d/*.bin", "seq_len": 64, "shuffle_files": True},
        validation=False,
    )
    assert isinstance(nano, NanogptSection) and nano.seq_length == 64


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"source": "megatron"}, "dataset.paths"),
        ({"source": "megatron", "paths": "x", "split": "a,b"}, "dataset.split"),
        (
            {"source": "megatron", "paths": "x", "splits_to_build": ["train", "test"]},
            "dataset.splits_to_build",
        ),
        ({"source": "megatron", "paths": "x", "seq_length": 1}, "dataset.seq_length"),
        ({"source": "megatron", "paths": "x", "blend": [1]}, "dataset.blend"),
        ({"source": "nanogpt", "file_pattern": "x", "align_to_bos": True}, "dataset.bos_token"),
        ({"_target_": "x.Unknown"}, "dataset._target_"),
    ],
)
def test_bad_sections_name_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_section(raw, validation=False)
    assert e.value.key == key


# ---- bad files: errors name the file ---------------------------------------------------------------
def test_truncated_and_mismatched_bin_name_the_file(tmp_path: Path) -> None:
    prefix = write_corpus(tmp_path / "c", random_docs(10))
    bin_path = Path(prefix + ".bin")
    data = bin_path.read_bytes()
    bin_path.write_bytes(data[:-6])
    with pytest.raises(ConfigError, match="is truncated") as e:
        build_megatron(megatron(prefix), Tok(), packed_sequence_size=0, seed=0)
    assert e.value.key == "dataset.paths" and str(bin_path) in str(e.value)
    bin_path.write_bytes(data + data)
    with pytest.raises(ConfigError, match="does not match") as e:
        build_megatron(megatron(prefix), Tok(), packed_sequence_size=0, seed=0)
    assert str(bin_path) in str(e.value)
    Path(prefix + ".idx").write_bytes(Path(prefix + ".idx").read_bytes()[:-8])
    with pytest.raises(ConfigError, match="header") as e:
        build_megatron(megatron(prefix), Tok(), packed_sequence_size=0, seed=0)
    assert prefix + ".idx" in str(e.value)


def test_vocab_beyond_dtype_empty_corpus_and_bad_weights(tmp_path: Path) -> None:
    prefix = write_corpus(tmp_path / "c", random_docs(10))
    with pytest.raises(ConfigError, match="another tokenizer") as e:
        build_megatron(megatron(prefix), Tok(vocab_size=70000), packed_sequence_size=0, seed=0)
    assert prefix + ".bin" in str(e.value)
    empty = write_corpus(tmp_path / "empty", [])
    with pytest.raises(ConfigError, match="empty corpus") as e:
        build_megatron(megatron(empty), Tok(), packed_sequence_size=0, seed=0)
    assert empty in str(e.value)
    with pytest.raises(ConfigError, match="fewer than one sample"):
        build_megatron(megatron(prefix, seq_length=100000), Tok(), packed_sequence_size=0, seed=0)
    for w in ("0", "-1"):
        with pytest.raises(ConfigError, match="must be > 0") as e:
            build_megatron(megatron([w, prefix, "1", prefix]), Tok(), packed_sequence_size=0, seed=0)
        assert prefix in str(e.value)
    write_nanogpt_shard(tmp_path / "s.bin", np.arange(50))
    (tmp_path / "s.bin").write_bytes((tmp_path / "s.bin").read_bytes()[:-10])
    with pytest.raises(ConfigError, match="truncated") as e:
        build_nanogpt(
            NanogptSection(file_pattern=str(tmp_path / "s.bin"), seq_len=4),
            Tok(),
            packed_sequence_size=0,
            seed=0,
        )
    assert "s.bin" in str(e.value)


def test_smallest_dtype_for_the_vocab() -> None:
    assert [token_dtype_for_vocab(v) for v in (256, 257, 65536, 65537, 200000)] == [
        np.uint8,
        np.uint16,
        np.uint16,
        np.int32,
        np.int32,
    ]


def test_a_new_kind_is_one_registration() -> None:
    """The registry is the only place a kind is wired: parse, build and the path check go through it."""
    from automodel.recipes.data import kinds

    kind: kinds.DatasetKind[ConstSection, ConstValidation] = kinds.DatasetKind(  # typed by its sections
        "const", ("const",), {"ConstDataset": "const"}, ConstSection, ConstValidation,
        f"{__name__}:_const_build", f"{__name__}:_const_check",
    )  # fmt: skip
    kinds.register(kind)
    try:
        section = kinds.parse_section({"_target_": "my.ConstDataset", "seq_length": 3}, validation=False)
        assert isinstance(section, ConstSection) and section.seq_length == 3
        assert kinds.build_dataset(section, Tok(), packed_sequence_size=0, seed=0) == ("built", 3)
        with pytest.raises(ConfigError, match="checked"):
            kinds.check_paths(section)
        with pytest.raises(ValueError, match="already"):
            kinds.register(kind)
    finally:
        kinds._KINDS.remove(kind)


@dataclass(frozen=True)
class ConstSection:
    SECTION: ClassVar[str] = "dataset"
    source: str = "const"
    seq_length: int = 4


@dataclass(frozen=True)
class ConstValidation(ConstSection):
    SECTION: ClassVar[str] = "validation_dataset"


def _const_build(section, tokenizer, *, packed_sequence_size, seed):
    return ("built", section.seq_length)


def _const_check(section):
    raise ConfigError("dataset", section.source, "checked")


def test_nanogpt_seq_len_errors_name_seq_len(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A rule on the sequence length names the key the user wrote: nanoGPT's ``seq_len``."""
    import sys

    import yaml

    from automodel.recipes.cli import run_cli

    sys.path.insert(0, str(Path(__file__).parent))
    from _recipe_helpers import tiny_config

    cfg = tiny_config(str(tmp_path / "out"))
    cfg["dataset"] = {"source": "nanogpt", "file_pattern": str(tmp_path / "*.bin"), "seq_len": 30}
    cfg["validation_dataset"] = None
    cfg.setdefault("distributed", {})["cp_size"] = 2
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert run_cli(["validate", str(path), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "error: dataset.seq_len=30" in err and "dataset.seq_length" not in err, err
