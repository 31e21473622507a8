"""Byte-level tokenizer (vocab 256, EOS = byte 0) and local Hugging Face tokenizers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from automodel.data.errors import ConfigError, optional
from automodel.data.trust import announce_remote_code

#: Files that make a directory a Hugging Face tokenizer directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def bos_prefix(tokenizer: Any) -> list[int]:
    """``[bos]`` when the tokenizer puts BOS before a text as it adds its special tokens (Llama does),
    else ``[]``. The one rule for where this project writes BOS itself: plain SFT examples,
    pretraining shards (`recipes preprocess`) and generation prompts all encode without special
    tokens and prepend this, so they start the way the tokenizer's own encoding does."""
    hf, bos = getattr(tokenizer, "hf", None), getattr(tokenizer, "bos_token_id", None)
    if hf is None or bos is None:
        return []
    ids = hf("a", add_special_tokens=True)["input_ids"]
    return [int(bos)] if ids and ids[0] == bos else []


def has_tokenizer_files(directory: str | Path) -> bool:
    """Whether `directory` holds a Hugging Face tokenizer (else a model directory carries none)."""
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


class ByteTokenizer:
    """UTF-8 bytes as token ids: needs no vocabulary file; byte 0 (absent from text) is EOS."""

    vocab_size = 256
    eos_token_id = 0
    pad_token_id = 0
    bos_token_id = None
    hf = None  # no transformers tokenizer behind it: no chat template
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [b for b in text.encode("utf-8") if b != 0]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")

    def prepends_bos(self) -> bool:
        return False  # no BOS token

    def save_pretrained(self, directory: str | Path) -> None:
        """Nothing to save: the byte tokenizer is fully described by its class."""


class HFTokenizer:
    """A local `transformers` tokenizer directory behind the same two-method interface."""

    def __init__(
        self, path: str, *, trust_remote_code: bool = False, add_bos_token: bool | None = None
    ) -> None:
        if not Path(path).is_dir():
            raise ConfigError("tokenizer.path", path, "is not a local directory")
        if trust_remote_code:
            announce_remote_code(key="tokenizer.trust_remote_code", path=path)
        try:
            extra = {} if add_bos_token is None else {"add_bos_token": add_bos_token}
            transformers = optional("transformers", needed_for="a Hugging Face tokenizer")
            self._tok = transformers.AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=trust_remote_code, **extra
            )
        except ValueError as e:
            if not trust_remote_code and "trust_remote_code" in str(e):
                raise ConfigError(
                    "tokenizer.trust_remote_code",
                    False,
                    f"{path} needs its own Python code (auto_map) to load; it was not run. "
                    "Set tokenizer.trust_remote_code: true only if you trust that directory",
                ) from None
            raise ConfigError(
                "tokenizer.path", path, f"cannot be loaded as a HF tokenizer ({type(e).__name__})"
            ) from None
        except Exception as e:  # noqa: BLE001 - any failure to load is a config problem
            raise ConfigError(
                "tokenizer.path", path, f"cannot be loaded as a HF tokenizer ({type(e).__name__})"
            ) from None
        eos = self._tok.eos_token_id
        if eos is None:
            raise ConfigError("tokenizer.path", path, "the tokenizer has no eos_token_id")
        self.eos_token_id = int(eos)
        self.vocab_size = len(self._tok)
        pad = self._tok.pad_token_id
        self.pad_token_id = self.eos_token_id if pad is None else int(pad)
        self.bos_token_id = self._tok.bos_token_id
        if add_bos_token is not None and self.prepends_bos() != add_bos_token:
            raise ConfigError(
                "tokenizer.add_bos_token",
                add_bos_token,
                f"is not honoured by {type(self._tok).__name__} at {path} "
                f"(bos_token_id {self.bos_token_id}); leave it unset to use the tokenizer's own setting",
            )

    def prepends_bos(self) -> bool:
        """Whether the tokenizer puts BOS before a text when it adds its special tokens (`bos_prefix`)."""
        return bool(bos_prefix(self))

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (chat templates, offsets)."""
        return self._tok

    @property
    def chat_template(self) -> str | None:
        return getattr(self._tok, "chat_template", None) or None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def save_pretrained(self, directory: str | Path) -> Any:
        return self._tok.save_pretrained(str(directory))


def build_tokenizer(
    path: str | None, *, trust_remote_code: bool = False, add_bos_token: bool | None = None
) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer, or the local HF tokenizer at `path` (its own code runs only if trusted);
    `add_bos_token` (YAML ``tokenizer.add_bos_token``) is set on it and checked, never assumed."""
    if path is None:
        if add_bos_token:
            raise ConfigError(
                "tokenizer.add_bos_token",
                True,
                "the byte tokenizer has no BOS; set tokenizer.path or leave it unset",
            )
        return ByteTokenizer()
    return HFTokenizer(path, trust_remote_code=trust_remote_code, add_bos_token=add_bos_token)
