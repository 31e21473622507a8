"""Small corpora for the data package's tests: random documents written by our `MegatronWriter`."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from automodel.data.megatron_writer import MegatronWriter


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
