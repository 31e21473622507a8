"""SFT data: answer-only masks checked token by token, packing keeps documents apart, bad data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from automodel.data.sft import IGNORE_INDEX, encode_chat, format_plain_prompt
from automodel.data.text_build import check_sft_paths
from automodel.data.text_sections import SFTDatasetSection, SFTValidationDatasetSection
from automodel.recipes.config.sections import build_section
from automodel.recipes.data import ByteTokenizer, build_packed_dataset, build_tokenizer
from automodel.recipes.errors import ConfigError
from automodel.testing.tiny_model import tiny_causal_lm

sys.path.insert(0, str(Path(__file__).parent))
from _sft_helpers import save_chat_tokenizer, write_arithmetic_jsonl  # noqa: E402


@pytest.fixture
def chat_tok(tmp_path: Path):
    vocab = save_chat_tokenizer(tmp_path / "tok")
    return build_tokenizer(str(tmp_path / "tok")), vocab


def _ids(vocab: dict[str, int], text: str) -> list[int]:
    return [vocab[w] for w in text.split()]


def test_chat_answer_mask_matches_hand_computed(chat_tok) -> None:
    tok, v = chat_tok
    messages = [
        {"role": "system", "content": "you are a bot"},
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "four"},
        {"role": "user", "content": "say hi"},
        {"role": "assistant", "content": "hello and hi"},
    ]
    # The template, token by token. As NeMo AutoModel 0.7 (ChatDataset's mask_generation_prompt: false,
    # its default) an assistant turn is its role header, content and <|end|>; with
    # mask_generation_prompt the header (what the generation prompt writes) is not labelled.
    prompt1 = "<|system|> you are a bot <|end|> <|user|> what is two plus two <|end|>"
    answer1 = "four <|end|>"
    prompt2 = "<|user|> say hi <|end|>"
    answer2 = "hello and hi <|end|>"
    for mask_generation_prompt in (False, True):
        ex = encode_chat(
            tok,
            messages,
            answer_only=True,
            key="dataset.use_hf_chat_template",
            mask_generation_prompt=mask_generation_prompt,
        )
        expected_ids, expected_mask = [], []
        parts = (prompt1, False), ("<|assistant|>", not mask_generation_prompt), (answer1, True)
        parts += (prompt2, False), ("<|assistant|>", not mask_generation_prompt), (answer2, True)
        for text, is_answer in parts:
            expected_ids += _ids(v, text)
            expected_mask += [is_answer] * len(text.split())
        assert ex.ids == expected_ids
        assert ex.label_mask == expected_mask
    full = encode_chat(tok, messages, answer_only=False, key="k")
    assert full.ids == expected_ids and all(full.label_mask)


def _section(**kw) -> SFTDatasetSection:
    return build_section(SFTDatasetSection, kw)


def test_instruction_rows_labels_token_by_token(tmp_path: Path, chat_tok) -> None:
    tok, v = chat_tok
    path = tmp_path / "d.jsonl"
    rows = [{"sys": "you are a bot", "q": "what is two plus three", "a": "five"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    section = _section(
        source="instruction",
        path_or_dataset_id=str(path),
        column_mapping={"context": "sys", "question": "q", "answer": "a"},
        seq_length=24,
    )
    ds = build_packed_dataset(section, tok, packed_sequence_size=0)
    ids, labels, pos = ds.batch([0])
    text = (
        "<|system|> you are a bot <|end|> <|user|> what is two plus three <|end|> <|assistant|> five <|end|>"
    )
    tokens = _ids(v, text)
    n = len(tokens) - 1
    assert ids[0, :n].tolist() == tokens[:-1]
    assert ids[0, n:].tolist() == [v["<pad>"]] * (24 - n)  # padding ...
    # the assistant turn as NeMo AutoModel labels it (its header too) ...
    answer = [v["<|assistant|>"], v["five"], v["<|end|>"]]
    expected = [IGNORE_INDEX] * (n - 3) + answer + [IGNORE_INDEX] * (24 - n)
    assert labels[0].tolist() == expected  # ... padding never carries loss
    # mask_generation_prompt: the header the generation prompt writes is not a label
    header_free = _section(**{**section.__dict__, "mask_generation_prompt": True})
    _, labels_hf, _ = build_packed_dataset(header_free, tok, packed_sequence_size=0).batch([0])
    assert labels_hf[0].tolist() == [IGNORE_INDEX] * (n - 2) + answer[1:] + [IGNORE_INDEX] * (24 - n)
    assert pos[0].tolist() == list(range(24))
    # answer_only_loss_mask: false trains every next token of the example, still not the padding
    section = _section(**{**section.__dict__, "answer_only_loss_mask": False})
    _, labels, _ = build_packed_dataset(section, tok, packed_sequence_size=0).batch([0])
    assert labels[0].tolist() == tokens[1:] + [IGNORE_INDEX] * (24 - n)


def test_plain_format_without_chat_template(tmp_path: Path) -> None:
    path = write_arithmetic_jsonl(tmp_path / "d.jsonl", n=3)
    section = _section(
        source="instruction",
        path_or_dataset_id=str(path),
        column_mapping={"question": "q", "answer": "a"},
        seq_length=16,
    )
    ds = build_packed_dataset(section, ByteTokenizer(), packed_sequence_size=0)
    ids, labels, _ = ds.batch([1])
    prompt, answer = format_plain_prompt(context=None, question="1+7="), "8"
    assert prompt == "1+7=\n"
    tokens = list(prompt.encode()) + list(answer.encode()) + [0]
    assert ids[0, : len(tokens) - 1].tolist() == tokens[:-1]
    # labels: the answer byte and the EOS after it, nothing for the prompt or the padding
    assert labels[0].tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + [ord("8"), 0] + [IGNORE_INDEX] * (
        16 - len(tokens) + 1
    )
    with pytest.raises(ConfigError, match="dataset.use_hf_chat_template"):
        build_packed_dataset(
            _section(**{**section.__dict__, "use_hf_chat_template": True}),
            ByteTokenizer(),
            packed_sequence_size=0,
        )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_equals_documents_one_by_one(tmp_path: Path, attn: str) -> None:
    path = write_arithmetic_jsonl(tmp_path / "d.jsonl", n=12)
    kw = {
        "source": "instruction",
        "path_or_dataset_id": str(path),
        "column_mapping": {"question": "q", "answer": "a"},
    }
    single = build_packed_dataset(_section(**kw, seq_length=16), ByteTokenizer(), packed_sequence_size=0)
    packed = build_packed_dataset(_section(**kw, seq_length=16), ByteTokenizer(), packed_sequence_size=64)
    assert len(single) == 12 and len(packed) < len(single)
    model = tiny_causal_lm(attn=attn).eval()

    def token_losses(ids, labels, pos):
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits  # as train.py
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)

    per_doc_single = []
    for i in range(len(single)):
        ids, labels, pos = single.batch([i])
        per_doc_single.append(token_losses(ids, labels, pos).sum().item())
    per_doc_packed = []
    for r in range(len(packed)):
        ids, labels, pos = packed.batch([r])
        losses = token_losses(ids, labels, pos)[0]
        starts = torch.nonzero(pos[0] == 0).flatten().tolist() + [pos.shape[1]]
        for a, b in zip(starts[:-1], starts[1:]):
            if (labels[0, a:b] != IGNORE_INDEX).any():  # the padding tail is a "document" without labels
                per_doc_packed.append(losses[a:b].sum().item())
    assert len(per_doc_packed) == len(per_doc_single)
    for got, ref in zip(per_doc_packed, per_doc_single):
        assert abs(got - ref) <= 1e-5 * abs(ref), (got, ref)
    # and a row whose positions do not restart (documents attending to each other) differs
    ids, labels, pos = packed.batch([0])
    crossed = token_losses(ids, labels, torch.arange(64).unsqueeze(0))[0]
    assert abs(crossed.sum().item() - token_losses(ids, labels, pos).sum().item()) > 1e-3


def test_bad_rows_are_skipped_and_counted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "d.jsonl"
    rows = [
        {"q": "1+1=", "a": "2"},
        {"q": "2+2=", "a": ""},  # empty answer
        {"q": "3+3=", "a": None},  # missing answer
        {"q": "", "a": "4"},  # no prompt
        {"q": "x" * 40, "a": "5"},  # longer than the row
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kw = {
        "source": "instruction",
        "path_or_dataset_id": str(path),
        "column_mapping": {"question": "q", "answer": "a"},
    }
    ds = build_packed_dataset(_section(**kw, seq_length=16), ByteTokenizer(), packed_sequence_size=0)
    assert len(ds) == 1
    assert ds.stats["skipped"] == {"empty answer": 2, "empty prompt": 1, "longer than the 16-token row": 1}
    assert "skipped 4 of 5" in capsys.readouterr().err
    # truncation keeps the long one while an answer token is left, cut to the row
    ds = build_packed_dataset(
        _section(**kw, seq_length=16, truncation=True), ByteTokenizer(), packed_sequence_size=0
    )
    assert ds.stats["skipped"] == {
        "empty answer": 2,
        "empty prompt": 1,
        "no answer token left after truncation": 1,
    }
    only_long = tmp_path / "long.jsonl"
    only_long.write_text(json.dumps({"q": "x" * 40, "a": "5"}) + "\n")
    with pytest.raises(ConfigError, match="yields no usable example"):
        build_packed_dataset(
            _section(**{**kw, "path_or_dataset_id": str(only_long)}, seq_length=16),
            ByteTokenizer(),
            packed_sequence_size=0,
        )


@pytest.mark.parametrize(
    ("data", "key"),
    [
        (
            {"source": "instruction", "path_or_dataset_id": "x.jsonl", "column_mapping": {"question": "q"}},
            "dataset.column_mapping.answer",
        ),
        (
            {"source": "instruction", "path_or_dataset_id": "x.jsonl", "column_mapping": {"answer": "a"}},
            "dataset.column_mapping",
        ),
        (
            {
                "source": "instruction",
                "path_or_dataset_id": "x.jsonl",
                "column_mapping": {"answer": "a", "prompt": "p"},
            },
            "dataset.column_mapping.prompt",
        ),
        (
            {"source": "instruction", "column_mapping": {"question": "q", "answer": "a"}},
            "dataset.path_or_dataset_id",
        ),
        ({"source": "chat", "path_or_dataset_id": "x.jsonl", "truncation": "middle"}, "dataset.truncation"),
        ({"source": "stdlib_docstrings", "path_or_dataset_id": "x.jsonl"}, "dataset.path_or_dataset_id"),
        ({"source": "stdlib_docstrings", "split": "test"}, "dataset.split"),
    ],
)
def test_section_errors_name_the_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        build_section(SFTDatasetSection, data)
    assert e.value.key == key


def test_nemo_target_and_missing_column(tmp_path: Path, chat_tok) -> None:
    from automodel.recipes.recipe_config import _dataset_section

    path = write_arithmetic_jsonl(tmp_path / "d.jsonl", n=4)
    nemo = {
        "_target_": "nemo_automodel.components.datasets.llm.column_mapped_text_instruction_dataset."
        "ColumnMappedTextInstructionDataset",
        "path_or_dataset_id": str(path),
        "column_mapping": {"question": "q", "answer": "answer_text"},
        "answer_only_loss_mask": True,
    }
    section = _dataset_section(nemo, validation=True)
    assert isinstance(section, SFTValidationDatasetSection) and section.source == "instruction"
    with pytest.raises(ConfigError) as e:
        build_packed_dataset(section, ByteTokenizer(), packed_sequence_size=0)
    assert e.value.key == "validation_dataset.column_mapping.answer" and "q, a" in str(e.value)
    with pytest.raises(ConfigError) as e:
        _dataset_section({**nemo, "_target_": "my.OwnDataset"}, validation=False)
    assert e.value.key == "dataset._target_"
    chat = _dataset_section({"_target_": "x.ChatDataset", "path_or_dataset_id": str(path)}, validation=False)
    with pytest.raises(ConfigError) as e:  # the byte tokenizer has no chat template
        build_packed_dataset(chat, ByteTokenizer(), packed_sequence_size=0)
    assert e.value.key == "dataset.source"


def test_chat_messages_jsonl(tmp_path: Path, chat_tok) -> None:
    tok, v = chat_tok
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]}
    no_answer = {"messages": [{"role": "user", "content": "say hi"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(no_answer) + "\n")
    ds = build_packed_dataset(
        _section(source="chat", path_or_dataset_id=str(path), seq_length=12), tok, packed_sequence_size=0
    )
    assert len(ds) == 1 and ds.stats["skipped"] == {"no assistant turn": 1}
    _, labels, _ = ds.batch([0])
    # the assistant turn with its header (AutoModel's ChatDataset default, mask_generation_prompt: false)
    assert [t for t in labels[0].tolist() if t != IGNORE_INDEX] == [v["<|assistant|>"], v["hi"], v["<|end|>"]]


ALTERNATING = (  # Llama-2 / Mistral style: refuses conversations whose roles do not alternate
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}{% endif %}"
    "<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def test_row_the_chat_template_refuses_is_skipped_and_counted(tmp_path: Path) -> None:
    save_chat_tokenizer(tmp_path / "tok", chat_template=ALTERNATING)
    tok = build_tokenizer(str(tmp_path / "tok"))
    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]}
    twice = {"messages": [{"role": "user", "content": "say"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": "hi"}]}  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, twice, good)))
    ds = build_packed_dataset(
        _section(source="chat", path_or_dataset_id=str(path), seq_length=12), tok, packed_sequence_size=0
    )
    assert len(ds) == 2
    assert ds.stats["skipped"] == {
        "refused by the chat template (Conversation roles must alternate user/assistant/user/assistant)": 1
    }


def test_stdlib_docstrings_examples() -> None:
    from automodel.data.stdlib_docstrings import stdlib_docstring_examples

    train, val = stdlib_docstring_examples(split="train"), stdlib_docstring_examples(split="validation")
    assert len(train) > 200 and 0 < len(val) < len(train) // 10
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    dedent = next(r for r in train + val if r["question"].startswith("textwrap.dedent("))
    import textwrap

    assert dedent["answer"] == textwrap.dedent.__doc__.strip().splitlines()[0]


BAD_FILE_ROWS = [
    ("encoding", b'{"q": "caf\xe9", "a": "x"}\n'),
    ("malformed_json", b'{"q": "2+2=", "a": \n'),
    ("not_an_object", b'["2+2=", "4"]\n'),
    ("wrong_type", b'{"q": "2+2=", "a": 4}\n'),
]


@pytest.mark.parametrize(("reason", "bad"), BAD_FILE_ROWS, ids=[r[0] for r in BAD_FILE_ROWS])
def test_bad_file_row_is_skipped_and_counted_with_bad_rows_skip(
    tmp_path: Path, capsys: pytest.CaptureFixture, reason: str, bad: bytes
) -> None:
    """``bad_rows: skip``: the bad row is counted under its reason and the rows are exactly those of
    the good rows alone; the default (error) names the file and line."""
    from automodel.data.file_check import check_sft_rows
    from automodel.recipes.errors import DataError

    good = [{"q": "1+1=", "a": "2"}, {"q": "3+3=", "a": "6"}]
    lines = [json.dumps(r).encode() + b"\n" for r in good]
    path, clean = tmp_path / "d.jsonl", tmp_path / "clean.jsonl"
    path.write_bytes(lines[0] + bad + lines[1])
    clean.write_bytes(b"".join(lines))
    kw = {"source": "instruction", "column_mapping": {"question": "q", "answer": "a"}, "seq_length": 16}
    with pytest.raises(DataError, match=f"{path}:2: "):
        check_sft_rows(_section(**kw, path_or_dataset_id=str(path)))
    section = _section(**kw, path_or_dataset_id=str(path), bad_rows="skip")
    check_sft_rows(section)  # the pre-launch check leaves the row to the reader
    ds = build_packed_dataset(section, ByteTokenizer(), packed_sequence_size=0)
    assert ds.stats["skipped"] == {reason: 1} and ds.stats["records"] == 3
    assert f"skipped 1 of 3 (1 {reason})" in capsys.readouterr().err
    ref = build_packed_dataset(
        _section(**kw, path_or_dataset_id=str(clean)), ByteTokenizer(), packed_sequence_size=0
    )
    assert len(ds) == len(ref) == 2
    for a, b in zip(ds.batch([0, 1]), ref.batch([0, 1]), strict=True):
        assert torch.equal(a, b)


def test_bad_rows_skip_validation_section_and_refusals(tmp_path: Path) -> None:
    """The validation section reads the same key; skip on a file it cannot read row by row or a
    file of only bad rows is refused with the key or the file named."""
    from automodel.recipes.errors import DataError

    path = tmp_path / "v.jsonl"
    path.write_bytes(b'{"q": "1+1=", "a": "2"}\n{"q": 1, "a": "2"}\n')
    kw = {"source": "instruction", "column_mapping": {"question": "q", "answer": "a"}, "seq_length": 16}
    val = build_section(
        SFTValidationDatasetSection, {**kw, "path_or_dataset_id": str(path), "bad_rows": "skip"}
    )
    ds = build_packed_dataset(val, ByteTokenizer(), packed_sequence_size=0)
    assert len(ds) == 1 and ds.stats["skipped"] == {"wrong_type": 1}
    with pytest.raises(ConfigError, match="dataset.bad_rows"):
        _section(**kw, path_or_dataset_id=str(path), bad_rows="drop")
    (tmp_path / "d.txt").write_text("x\n")
    # the section reads no disk: which files skip can read is the pre-launch path check's
    txt = _section(**kw, path_or_dataset_id=str(tmp_path / "d.txt"), bad_rows="skip")
    with pytest.raises(ConfigError, match="applies to .jsonl, .json, .csv, .parquet files, not .*d.txt"):
        check_sft_paths(txt)
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_bytes(b'"x"\n{\n')
    with pytest.raises(DataError, match="no good rows .skipped 1 malformed_json, 1 not_an_object"):
        build_packed_dataset(
            _section(**kw, path_or_dataset_id=str(only_bad), bad_rows="skip"),
            ByteTokenizer(),
            packed_sequence_size=0,
        )
