"""Token ids the model cannot embed: refused naming where they come from, not a CUDA assert.

An id at or above the model's ``vocab_size`` (a corpus written with another tokenizer, a damaged
file, a tokenizer with sparse ids) ended as a 76-103 line dump from the embedding or the loss that
named neither the file nor the id. Three checks, cheapest first:

- before launch, the tokenizer: its largest id (vocabulary and special tokens) against the model's
  ``vocab_size`` (`check_tokenizer_ids`, also run in each rank on the tokenizer it builds);
- before launch, each Megatron / nanoGPT file: nothing to read when its token dtype cannot hold an
  id that large, else the first and last `SAMPLE_TOKENS` tokens (`check_corpus_ids`);
- in the ranks, every batch read: one ``max()`` over its ids (`check_batch_ids`), the hit named by
  the dataset's ``token_location`` (file and token) or its sample number.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from automodel.data.errors import ConfigError, DataError
from automodel.data.pretrain_build import corpus_files
from automodel.data.sections import DataSection

#: Tokens read at each end of a corpus file before launch (256 KiB of uint16 per end).
SAMPLE_TOKENS = 1 << 17


class TokenIdError(DataError):
    """A token id outside ``0 .. vocab_size - 1``; the message names the file, position and id."""


def _beyond(vocab_size: int) -> str:
    return f"outside the model's vocab_size {vocab_size} (ids 0..{vocab_size - 1})"


# ---- the tokenizer -------------------------------------------------------------------------------
def tokenizer_max_id(tokenizer: Any) -> tuple[int, str]:
    """``(largest id, its token)`` the tokenizer can produce: its vocabulary (added tokens
    included) and special tokens; a tokenizer's ids need not be dense, so not ``len - 1``."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return int(tokenizer.vocab_size) - 1, "the byte tokenizer's largest byte"
    best, name = -1, ""
    for token, i in hf.get_vocab().items():
        if int(i) > best:
            best, name = int(i), repr(token)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        i = getattr(hf, attr, None)
        if isinstance(i, int) and i > best:
            best, name = i, attr
    return best, name


def check_tokenizer_ids(tokenizer: Any, *, vocab_size: int, path: str | None, vocab_key: str) -> None:
    """Every id the tokenizer yields is one the model embeds (`ConfigError` naming both keys)."""
    top, token = tokenizer_max_id(tokenizer)
    if top >= vocab_size:
        key, value = ("tokenizer.path", path) if path is not None else (vocab_key, vocab_size)
        raise ConfigError(
            key,
            value,
            f"the tokenizer yields id {top} ({token}), {_beyond(vocab_size)} ({vocab_key}); "
            "use the model's own tokenizer or a model with a larger vocab_size",
        )


# ---- corpus files before launch ------------------------------------------------------------------
def _first_bad(tokens: np.ndarray, vocab_size: int) -> int | None:
    if tokens.size == 0:
        return None
    bad = (tokens >= vocab_size) | (tokens < 0) if tokens.dtype.kind == "i" else tokens >= vocab_size
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def check_file_ids(
    source: Any, *, path: str, num_tokens: int, dtype: np.dtype, vocab_size: int, sample: int = SAMPLE_TOKENS
) -> None:
    """The first and last `sample` tokens of a token file (``source.tokens(start, stop)``) are ids
    below `vocab_size`; skipped when `dtype` cannot hold an id that large."""
    dtype = np.dtype(dtype)
    if dtype.kind == "u" and int(np.iinfo(dtype).max) < vocab_size:
        return  # every id this file can hold is one the model embeds
    windows = [(0, min(num_tokens, sample))]
    if num_tokens > sample:
        windows.append((max(sample, num_tokens - sample), num_tokens))
    for start, stop in windows:
        tokens = source.tokens(start, stop)
        k = _first_bad(tokens, vocab_size)
        if k is not None:
            raise TokenIdError(
                f"{path}: token {start + k} is id {int(tokens[k])}, {_beyond(vocab_size)}: the file was "
                "written with another tokenizer, or is damaged"
            )


def check_corpus_ids(section: DataSection, *, vocab_size: int) -> None:
    """Megatron and nanoGPT sections: each file's sampled ids (`check_file_ids`); other kinds are
    tokenized here by the checked tokenizer."""
    for path, source in corpus_files(section):
        check_file_ids(
            source, path=path, num_tokens=source.num_tokens, dtype=source.dtype, vocab_size=vocab_size
        )


# ---- batches in the ranks ------------------------------------------------------------------------
def check_batch_ids(
    dataset: Any, indices: list[int], input_ids: torch.Tensor, labels: torch.Tensor, *, vocab_size: int
) -> None:
    """One max() (and min()) over a micro-batch's ids; a hit is a `TokenIdError` naming the file and
    token (``dataset.token_location(sample, position)``) or the dataset's sample number."""
    if input_ids.numel() == 0:
        return
    top = max(int(input_ids.max()), int(labels.max()))
    if top < vocab_size and int(input_ids.min()) >= 0:
        return
    bad_in = (input_ids >= vocab_size) | (input_ids < 0)
    bad_label = labels >= vocab_size  # -100: a label without loss
    if bool(bad_in.any()):
        row, pos = (int(v) for v in bad_in.nonzero()[0])
        value = int(input_ids[row, pos])
    else:
        row, pos = (int(v) for v in bad_label.nonzero()[0])
        value, pos = int(labels[row, pos]), pos + 1  # the label of position p is token p + 1
    sample = int(indices[row])
    locate = getattr(dataset, "token_location", None)
    where = locate(sample, pos) if locate is not None else None
    at = f"{where[0]}: token {where[1]}" if where is not None else f"token {pos}"
    raise TokenIdError(
        f"{at} (sample {sample}) is id {value}, {_beyond(vocab_size)}: the data was written with "
        "another tokenizer, or is damaged"
    )
