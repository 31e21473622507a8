"""Data: embedded corpus, byte tokenizer, packing with document boundaries, the stateful sampler."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from automodel.data.packing import PackedDataset, document_position_ids
from automodel.data.text_sections import DatasetSection
from automodel.recipes.data import (
    ByteTokenizer,
    StatefulGlobalBatchSampler,
    embedded_documents,
    pack_documents,
)
from automodel.recipes.data.kinds import build_packed_dataset


def test_embedded_corpus_is_real_deterministic_text_with_a_disjoint_holdout() -> None:
    train = embedded_documents(split="train", max_bytes=50_000)
    again = embedded_documents(split="train", max_bytes=50_000)
    val = embedded_documents(split="validation", max_bytes=50_000)
    assert train == again and sum(map(len, train)) == 50_000
    assert any("def " in d for d in train)
    assert not set(train) & set(val)


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld\n"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.eos_token_id not in ids
    assert tok.decode(ids) == text


def test_packing_keeps_document_boundaries() -> None:
    tokens = pack_documents([[5, 6, 7], [8, 9], [10, 11, 12, 13]], eos_token_id=0)
    assert tokens.tolist() == [5, 6, 7, 0, 8, 9, 0, 10, 11, 12, 13, 0]
    ds = PackedDataset(tokens, seq_length=5, eos_token_id=0, document_boundaries=True)
    ids, labels, pos = ds.batch([0, 1])
    assert ids.tolist() == [[5, 6, 7, 0, 8], [0, 10, 11, 12, 13]]
    assert labels.tolist() == [[6, 7, 0, 8, 9], [10, 11, 12, 13, 0]]
    assert pos.tolist() == [[0, 1, 2, 3, 0], [0, 0, 1, 2, 3]]
    plain = PackedDataset(tokens, seq_length=5, eos_token_id=0, document_boundaries=False)
    assert plain.batch([1])[2].tolist() == [[0, 1, 2, 3, 4]]
    assert document_position_ids(torch.tensor([[0, 0, 3]]), 0).tolist() == [[0, 0, 0]]


def _sampler(dp_rank: int, dp: int, local: int = 2) -> StatefulGlobalBatchSampler:
    return StatefulGlobalBatchSampler(
        num_rows=40, global_batch_size=8, local_batch_size=local, dp_rank=dp_rank, dp_size=dp, seed=3
    )


def test_sampler_partitions_the_same_global_batch_for_every_dp_size() -> None:
    for dp in (1, 2, 4):  # 7 steps cross an epoch boundary (5 steps per epoch)
        samplers = [_sampler(r, dp) for r in range(dp)]
        ref = _sampler(0, 1, local=8)
        for _ in range(7):
            got = [i for s in samplers for mb in s.next_step() for i in mb]
            want = [i for mb in ref.next_step() for i in mb]
            assert sorted(got) == sorted(want) and len(set(got)) == 8


def test_sampler_state_dict_resumes_exactly() -> None:
    a = _sampler(1, 2)
    for _ in range(6):
        a.next_step()
    b = _sampler(1, 2)
    b.load_state_dict(a.state_dict())
    assert [a.next_step() for _ in range(5)] == [b.next_step() for _ in range(5)]
    assert a.state_dict()["epoch"] == 2


def test_epochs_reshuffle() -> None:
    s = _sampler(0, 1, local=8)
    first = [s.next_step()[0] for _ in range(5)]
    second = [s.next_step()[0] for _ in range(5)]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(40))
    assert first != second


def test_local_jsonl_through_datasets(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"body": f"document number {i} " * 5}) for i in range(20)))
    section = DatasetSection(source="json", path=str(path), text_key="body", seq_length=16)
    ds = build_packed_dataset(section, ByteTokenizer(), packed_sequence_size=0)
    total = sum(len(f"document number {i} " * 5) + 1 for i in range(20))
    assert len(ds) == total // 17
    ids, labels, _ = ds.batch([0])
    flat = "".join(f"document number {i} " * 5 + "\0" for i in range(20)).encode()
    for row in (0, 1, len(ds) - 1):
        assert ds.batch([row])[0][0].tolist() == list(flat[row * 17 : row * 17 + 16])
    assert torch.equal(ids[0, 1:], labels[0, :-1])


def test_local_hf_tokenizer_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from automodel.recipes.data import build_tokenizer

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3, "again": 4}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(
        tmp_path / "tok"
    )
    hf = build_tokenizer(str(tmp_path / "tok"))
    assert hf.eos_token_id == 1 and hf.vocab_size == 5
    assert hf.encode("hello world again") == [2, 3, 4]
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": "hello world again hello"}) for _ in range(10)))
    ds = build_packed_dataset(
        DatasetSection(source="json", path=str(path), seq_length=4), hf, packed_sequence_size=0
    )
    assert len(ds) == 10 and ds.rows[0].tolist() == [2, 3, 4, 2, 1]
