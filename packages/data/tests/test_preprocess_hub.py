"""`preprocess` reads a Hub dataset id from the local Hugging Face cache (never a download): the
cached snapshot's files become Megatron shards, token for token; an id not in the cache is refused
by name before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from automodel.data.errors import ConfigError
from automodel.data.megatron_corpus import MegatronCorpus
from automodel.data.preprocess import preprocess

SNAPSHOT = "0" * 40


def test_a_cached_hub_dataset_id_becomes_megatron_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("huggingface_hub")
    repo = tmp_path / "hub" / "datasets--tiny-org--texts"  # the cache's own layout: refs/ and snapshots/
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    data = repo / "snapshots" / SNAPSHOT / "data"
    data.mkdir(parents=True)
    texts = [f"document {i} " * (1 + i % 7) for i in range(120)]
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    out = tmp_path / "out"
    manifest = preprocess(
        inputs=["tiny-org/texts"], output_dir=str(out), workers=2, shard_bytes=1024, progress=False
    )
    docs = []
    for idx in sorted(out.glob("shard_*.idx")):
        corpus = MegatronCorpus(idx)
        docs += [corpus.sequence(i).tolist() for i in range(corpus.num_sequences)]
    assert docs == [list(t.encode()) + [0] for t in texts]  # bytes, then EOS (byte 0), in file order
    assert manifest["totals"]["shards"] > 1 and manifest["totals"]["documents"] == len(texts)

    with pytest.raises(ConfigError) as e:
        preprocess(inputs=["tiny-org/absent"], output_dir=str(tmp_path / "none"), progress=False)
    assert e.value.key == "preprocess input" and "not in the local Hugging Face cache" in str(e.value)
    assert not (tmp_path / "none").exists()
