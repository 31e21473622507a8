"""`recipes preprocess`: text in, Megatron shards out (read back here and by megatron-core), manifest
with checksums, restart without redoing finished shards, BOS/EOS and dtype from the tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from automodel.data.megatron_corpus import MegatronCorpus
from automodel.data.preprocess import preprocess
from automodel.recipes.cli import run_cli

WORDS = [f"w{i}" for i in range(300)]


def _texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(3, 30)))) for _ in range(n)]


def _corpus_folder(root: Path) -> list[str]:
    """jsonl + text lines + parquet + a JSON array; returns the documents in shard order."""
    root.mkdir()
    a, b, c, d = _texts(400, 0), _texts(50, 1), _texts(120, 2), _texts(30, 3)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(a)))
    (root / "b.txt").write_text("\n".join(b) + "\n")
    pq.write_table(pa.table({"text": c}), root / "c.parquet", row_group_size=40)
    (root / "d.json").write_text(json.dumps([{"text": t} for t in d]))
    return a + b + c + d


def _shard_docs(out: Path) -> list[list[int]]:
    docs = []
    for idx in sorted(out.glob("shard_*.idx")):
        corpus = MegatronCorpus(idx)
        docs += [corpus.sequence(i).tolist() for i in range(corpus.num_sequences)]
    return docs


def test_byte_tokenizer_shards_read_back_here_and_in_megatron_core(tmp_path: Path) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = _corpus_folder(tmp_path / "in")
    out = tmp_path / "out"
    manifest = preprocess(
        inputs=[str(tmp_path / "in")], output_dir=str(out), workers=2, shard_bytes=4096, progress=False
    )
    expected = [list(t.encode()) + [0] for t in texts]  # bytes, then EOS (byte 0)
    assert _shard_docs(out) == expected
    assert manifest["dtype"] == "uint8" and manifest["tokenizer"]["prepend_bos"] is False
    assert manifest["totals"]["documents"] == len(texts)
    assert manifest["totals"]["tokens"] == sum(len(e) for e in expected)
    assert manifest["totals"]["shards"] > 4  # jsonl cut into byte ranges, parquet into row groups
    for name, entry in manifest["shards"].items():
        assert hashlib.sha256((out / f"{name}.bin").read_bytes()).hexdigest() == entry["bin_sha256"]
        assert hashlib.sha256((out / f"{name}.idx").read_bytes()).hexdigest() == entry["idx_sha256"]
        theirs = IndexedDataset(str(out / name))
        assert len(theirs) == entry["documents"]
    assert json.loads((out / "manifest.json").read_text())["totals"] == manifest["totals"]


def test_restart_skips_finished_shards(tmp_path: Path) -> None:
    _corpus_folder(tmp_path / "in")
    out = tmp_path / "out"
    first = preprocess(inputs=[str(tmp_path / "in")], output_dir=str(out), shard_bytes=4096, progress=False)
    n = first["totals"]["shards"]
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("shard_*")}
    # an interrupted run: one shard never renamed into place, its temporaries left behind
    (out / "shard_00002.bin").rename(out / "shard_00002.bin.tmp")
    (out / "shard_00002.idx").unlink()
    again = preprocess(inputs=[str(tmp_path / "in")], output_dir=str(out), shard_bytes=4096, progress=False)
    assert again["last_run"]["shards_written"] == 1 and again["last_run"]["shards_skipped"] == n - 1
    assert again["shards"]["shard_00002"]["bin_sha256"] == first["shards"]["shard_00002"]["bin_sha256"]
    for p in out.glob("shard_*"):
        if not p.name.startswith("shard_00002") and not p.name.endswith(".tmp"):
            assert p.stat().st_mtime_ns == stamps[p.name], p.name
    with pytest.raises(Exception, match="another shard_bytes"):
        preprocess(inputs=[str(tmp_path / "in")], output_dir=str(out), shard_bytes=8192, progress=False)


def _bos_tokenizer(directory: Path) -> None:
    """A word-level tokenizer (vocab 303 > 256: uint16 shards) that adds BOS like Llama's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)


def test_cli_with_the_runs_tokenizer_adds_bos_and_eos(tmp_path: Path, capsys) -> None:
    _bos_tokenizer(tmp_path / "tok")
    texts = _texts(60, 5)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {{config: {{model_type: llama, vocab_size: 320}}}}\ntokenizer: {{path: {tmp_path / 'tok'}}}\n"
    )
    args = [
        "preprocess",
        str(tmp_path / "docs.jsonl"),
        "--output",
        str(tmp_path / "out"),
        "--text-key",
        "body",
    ]
    assert run_cli([*args, "--config", str(config), "--no-progress", "--workers", "1"]) == 0
    assert "60 documents" in capsys.readouterr().err
    vocab = {w: i + 3 for i, w in enumerate(WORDS)}
    assert _shard_docs(tmp_path / "out") == [[1] + [vocab[w] for w in t.split()] + [2] for t in texts]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["dtype"] == "uint16" and manifest["tokenizer"]["prepend_bos"] is True
    assert run_cli(["preprocess", str(tmp_path / "docs.jsonl"), "--output", str(tmp_path / "o2")]) == 2
    assert "--text-key='text'" in capsys.readouterr().err  # names the key and the file


def test_readme_flow_builds_the_example_datasets(tmp_path: Path) -> None:
    """README "Pretrain on your corpus": the shipped stdlib text -> preprocess -> the example's datasets."""
    from automodel.data.tokenizer import ByteTokenizer
    from automodel.recipes.data import embedded_documents
    from automodel.recipes.data.kinds import build_dataset, check_paths
    from automodel.recipes.loader import load_config
    from automodel.recipes.recipe_config import parse_recipe_config

    example = Path(__file__).resolve().parents[3] / "examples" / "pretrain_shards.yaml"
    corpus = tmp_path / "stdlib.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": t}) + "\n" for t in embedded_documents(max_bytes=2_000_000))
    )
    shards = tmp_path / "shards"
    assert (
        run_cli(
            ["preprocess", str(corpus), "--output", str(shards), "--config", str(example), "--no-progress"]
        )
        == 0
    )
    over = [f"--dataset.paths={shards}", f"--validation_dataset.paths={shards}"]
    cfg = parse_recipe_config(load_config(example, over))
    val_batches = cfg.step_scheduler.val_batches
    assert val_batches is not None  # the example validates on a fixed number of batches
    for section in (cfg.dataset, cfg.validation_dataset):
        check_paths(section)
        ds = build_dataset(section, ByteTokenizer(), packed_sequence_size=0, seed=cfg.seed)
        assert len(ds) >= cfg.step_scheduler.global_batch_size * val_batches
