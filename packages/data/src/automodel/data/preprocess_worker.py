"""One `recipes preprocess` task in a worker process: read documents, tokenize, write one shard.

The shard is written under temporary names and renamed when complete, so a shard that exists
is whole; an interrupted task leaves only temporaries, overwritten when the task runs again.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from automodel.data.megatron_writer import MegatronWriter
from automodel.data.preprocess_inputs import Task, read_documents
from automodel.data.tokenizer import build_tokenizer

BATCH_DOCS = 1024


@dataclass(frozen=True)
class TokenizerSpec:
    """How workers rebuild the run's tokenizer, and what it adds around each document."""

    path: str | None  # None: the byte tokenizer
    trust_remote_code: bool
    prepend_bos: bool


_TOKENIZER: Any = None
_SPEC: TokenizerSpec | None = None


def adopt_tokenizer(spec: TokenizerSpec, tok: Any) -> None:
    """Use the launching process's tokenizer: forked workers inherit it instead of loading their own."""
    global _TOKENIZER, _SPEC
    _TOKENIZER, _SPEC = tok, spec


def init_worker(spec: TokenizerSpec) -> None:
    """Pool initializer: one tokenizer per worker process (no nested tokenizer threads); a worker
    forked after `adopt_tokenizer` keeps the inherited one."""
    global _TOKENIZER, _SPEC
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    if _TOKENIZER is not None and _SPEC == spec:
        return

    _TOKENIZER, _SPEC = build_tokenizer(spec.path, trust_remote_code=spec.trust_remote_code), spec


def encode_batch(tok: Any, texts: list[str]) -> list[Any]:
    """Token ids of each text, without special tokens. A fast tokenizer encodes the batch in one
    call of its Rust backend, without the offsets and Python lists transformers' call builds."""
    if tok.hf is not None:
        backend = getattr(tok.hf, "backend_tokenizer", None)
        fast = getattr(backend, "encode_batch_fast", None)
        if fast is not None:
            return [np.asarray(e.ids, dtype=np.int64) for e in fast(texts, add_special_tokens=False)]
        return tok.hf(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    out = []
    for t in texts:
        b = np.frombuffer(t.encode("utf-8"), dtype=np.uint8)
        out.append(b[b != 0])
    return out


def run_task(task: Task, *, out_dir: str, text_key: str, dtype: str, spec: TokenizerSpec) -> dict:
    """Write ``<out_dir>/<task.name>.bin/.idx``; returns the shard's manifest entry."""
    tok = _TOKENIZER
    eos, bos = tok.eos_token_id, tok.bos_token_id if spec.prepend_bos else None
    prefix = Path(out_dir) / task.name
    tmp_bin, tmp_idx = f"{prefix}.bin.tmp", f"{prefix}.idx.tmp"
    writer = MegatronWriter(prefix, dtype=np.dtype(dtype), bin_path=tmp_bin)
    skipped = 0
    batch: list[str] = []

    def flush() -> None:
        if batch:
            docs = encode_batch(tok, batch)
            writer.add_documents(docs, bos=bos, eos=eos)
        batch.clear()

    for text in read_documents(task, text_key=text_key):
        if not isinstance(text, str) or not text:
            skipped += 1
            continue
        batch.append(text)
        if len(batch) >= BATCH_DOCS:
            flush()
    flush()
    writer.finalize(tmp_idx)
    entry = {
        "name": task.name,
        "input": task.key(),
        "documents": writer.num_documents,
        "skipped_empty": skipped,
    }
    if writer.num_documents == 0:  # nothing to train on: no shard (an empty corpus cannot be read)
        os.remove(tmp_bin)
        os.remove(tmp_idx)
        return {**entry, "tokens": 0}
    idx_sha = hashlib.sha256(Path(tmp_idx).read_bytes()).hexdigest()
    os.replace(tmp_bin, f"{prefix}.bin")
    os.replace(tmp_idx, f"{prefix}.idx")
    return {
        **entry,
        "tokens": writer.num_tokens,
        "bin_bytes": Path(f"{prefix}.bin").stat().st_size,
        "bin_sha256": writer.bin_sha256.hexdigest(),
        "idx_sha256": idx_sha,
    }
