"""The local artefacts both trainers read in `automodel_peer_cpu.py`: one tiny random Llama saved as an
HF directory, a character-level tokenizer saved beside it (no Hub), and deterministic SQuAD-,
HellaSwag- and chat-format rows (no dataset download is possible here).

Two model directories hold the same weights and differ only in the tokenizer's post-processor:

- ``model_bos/``: the tokenizer prepends BOS and appends nothing, as Llama 3.2's ``tokenizer.json``
  ("as written"). AutoModel 0.7 counts BOS in the prompt length only when ``tokenizer.add_bos_token``
  is set, which transformers >= 5.18 drops when ``tokenizer.json`` exists, and takes the EOS from the
  tokenizer: it labels the prompt's last token and the answer, no EOS. Ours labels the answer and EOS.
- ``model_eos/``: the same vocabulary, no BOS, EOS appended by the tokenizer. AutoModel's prompt
  length is then right and its EOS is there: both label exactly the answer and EOS ("equal labels").
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
#: Llama 3's chat markers (the chat files' templates write them): one token each.
CHAT_MARKERS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHARS = sorted(set(string.printable) - set("\x0b\x0c\r"))
WORDS = (
    "the river city north south old new king queen stone bridge market harbor tower garden school "
    "church mountain valley forest lake island castle road village people river army war peace year "
    "built opened founded named known largest first second famous library museum council"
).split()
MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
}


def vocabulary() -> dict[str, int]:
    """Special tokens first, then one id per printable character."""
    return {t: i for i, t in enumerate([UNK, BOS, EOS, PAD, *CHAT_MARKERS, *CHARS])}


def save_tokenizer(directory: Path, *, bos: bool) -> None:
    """A character-level BPE without merges; `bos`: Llama 3's post-processor (BOS first), else EOS last. No chat
    template, as Llama 3.2 1B's base tokenizer: both trainers then format SQuAD and HellaSwag as
    plain prompt + answer; the chat file names its own template."""
    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, vocab[EOS])]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=CHAT_MARKERS,
    )
    fast.save_pretrained(str(directory))


def save_model(directory: Path, *, seed: int = 0) -> None:
    """A tiny fp32 Llama of random weights (the same for the same seed)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = vocabulary()
    config = LlamaConfig(
        vocab_size=len(vocab),
        bos_token_id=vocab[BOS],
        eos_token_id=vocab[EOS],
        pad_token_id=vocab[PAD],
        tie_word_embeddings=False,
        **MODEL,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).float().save_pretrained(str(directory))


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def squad_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        context = " ".join(_sentence(rng, rng.randint(6, 14)) for _ in range(rng.randint(2, 6)))
        words = context.rstrip(".").split()
        start = rng.randrange(len(words) - 3)
        answer = " ".join(words[start : start + rng.randint(1, 3)]).strip(".")
        question = f"What is {rng.choice(WORDS)} {rng.choice(WORDS)}?"
        rows.append(
            {
                "id": str(i),
                "title": rng.choice(WORDS),
                "context": context,
                "question": question,
                "answers": {"text": [answer], "answer_start": [context.find(answer)]},
            }
        )
    return rows


def hellaswag_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for i in range(n):
        ctx = _sentence(rng, rng.randint(8, 20))
        endings = [_sentence(rng, rng.randint(4, 12)) for _ in range(4)]
        rows.append(
            {
                "ind": i,
                "activity_label": rng.choice(WORDS),
                "ctx_a": ctx,
                "ctx_b": "",
                "ctx": ctx,
                "endings": endings,
                "source_id": f"peer~{i}",
                "split": "train",
                "split_type": "indomain",
                "label": str(rng.randrange(4)),
            }
        )
    return rows


def chat_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": "You answer briefly."}]
        for _turn in range(rng.randint(1, 2)):
            messages.append({"role": "user", "content": f"Tell me of the {rng.choice(WORDS)}."})
            messages.append({"role": "assistant", "content": _sentence(rng, rng.randint(4, 16))})
        rows.append({"messages": messages})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_artefacts(root: Path, *, rows: int, validation_rows: int = 64, seed: int = 0) -> dict[str, Path]:
    """Everything under `root`; returns the paths by name (``model_bos``, ``model_eos``, ``squad``,
    ``hellaswag``, ``chat``). Dataset folders hold ``train.jsonl`` and ``validation.jsonl``, which both
    trainers read as the split of that name."""
    paths = {
        "model_bos": root / "model_bos",
        "model_eos": root / "model_eos",
        "squad": root / "squad",
        "hellaswag": root / "hellaswag",
        "chat": root / "chat",
    }
    for bos, key in ((True, "model_bos"), (False, "model_eos")):
        save_model(paths[key], seed=seed)
        save_tokenizer(paths[key], bos=bos)
    makers = {"squad": squad_rows, "hellaswag": hellaswag_rows, "chat": chat_rows}
    for name, make in makers.items():
        rng = random.Random(f"{name}-{seed}")
        _write_jsonl(paths[name] / "train.jsonl", make(rng, rows))
        _write_jsonl(paths[name] / "validation.jsonl", make(rng, validation_rows))
    return paths
