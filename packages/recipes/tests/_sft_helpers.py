"""A local chat tokenizer (no download) and small instruction data for the SFT tests."""

from __future__ import annotations

import json
from pathlib import Path

#: One token per word; the chat markers are special tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
SPECIAL = ["<unk>", "<pad>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = "you are a bot what is two plus three four five six seven say hi hello ok and".split()


def save_chat_tokenizer(directory: Path, *, chat_template: str | None = CHAT_TEMPLATE) -> dict[str, int]:
    """A WordLevel tokenizer (whitespace words + special chat markers) saved with `chat_template`;
    returns its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        eos_token="</s>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"],
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return vocab


def write_arithmetic_jsonl(path: Path, *, n: int = 64) -> Path:
    """``{"q": "12+7=", "a": "19"}`` rows: short enough for the tiny model's 32-token rows."""
    rows = [{"q": f"{i % 13}+{(7 * i) % 11}=", "a": str(i % 13 + (7 * i) % 11)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def arithmetic_instruction_section(tmp: Path, *, seq_length: int) -> dict:
    """A ``dataset:`` section over 64 `write_arithmetic_jsonl` rows in ``tmp``: answer-only
    instruction rows of at most `seq_length` tokens."""
    return {
        "source": "instruction",
        "path_or_dataset_id": str(write_arithmetic_jsonl(tmp / "sft.jsonl", n=64)),
        "column_mapping": {"question": "q", "answer": "a"},
        "answer_only_loss_mask": True,
        "seq_length": seq_length,
    }
