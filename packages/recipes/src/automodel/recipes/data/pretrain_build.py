"""Build the memory-mapped pretraining datasets from their sections (and check their files first).

Every corpus is opened (O(1): headers and sizes) before any sample is read, so a missing,
truncated or mismatched file, a shard dtype too small for the tokenizer, or an empty split is a
`ConfigError` naming the key and the file, raised in the launching process.
"""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import numpy as np

from automodel.recipes.data.blend import BlendedSamples, blend_counts
from automodel.recipes.data.corpus_error import CorpusError
from automodel.recipes.data.megatron_corpus import MegatronCorpus
from automodel.recipes.data.megatron_paths import parse_split, resolve_blend, split_range
from automodel.recipes.data.nanogpt_shard import NanogptShard
from automodel.recipes.data.pretrain_sections import MegatronPretrainingSection, NanogptSection
from automodel.recipes.data.sample_order import BlockShuffledOrder, SequentialOrder, ShuffledOrder
from automodel.recipes.data.token_windows import TokenSpan, TokenWindows
from automodel.recipes.errors import ConfigError


def _open(opener: Any, path: str, *, key: str) -> Any:
    try:
        return opener(path)
    except CorpusError as e:
        raise ConfigError(key, e.path, e.why) from None


def check_vocab_fits(*, dtype: np.dtype, vocab_size: int | None, path: str, key: str) -> None:
    """The tokenizer's ids must be representable in the shard's token dtype."""
    if vocab_size is None or dtype.kind not in "iu":
        return
    limit = int(np.iinfo(dtype).max) + 1
    if vocab_size > limit:
        raise ConfigError(
            key,
            path,
            f"stores {dtype} tokens (ids < {limit}) but the tokenizer has {vocab_size}: "
            "it was written with another tokenizer",
        )


# ---- Megatron ------------------------------------------------------------------------------------
def megatron_spans(
    section: MegatronPretrainingSection, *, vocab_size: int | None
) -> tuple[list[TokenSpan], list[float] | None]:
    """One span per corpus (its part for ``splits_to_build``), and the blend weights if any."""
    key = f"{section.SECTION}.paths"
    split_name = section.split_name
    prefixes, weights, uses_split = resolve_blend(section.paths, split_name=split_name, key=key)
    ratios = parse_split(section.split, key=f"{section.SECTION}.split")
    spans = []
    for prefix in prefixes:
        corpus = _open(MegatronCorpus, prefix, key=key)
        check_vocab_fits(dtype=corpus.dtype, vocab_size=vocab_size, path=str(corpus.bin_path), key=key)
        first, stop = (
            split_range(corpus.num_sequences, ratios, split_name) if uses_split else (0, corpus.num_sequences)
        )
        start, end = corpus.sequence_token_range(first, stop)
        spans.append(TokenSpan(source=corpus, start=start, stop=end, name=prefix))
    return spans, weights


def build_megatron(
    section: MegatronPretrainingSection, tokenizer: Any, *, packed_sequence_size: int, seed: int
) -> Any:
    """Samples of ``seq_length + 1`` tokens (Megatron's stride), blended when ``paths`` has weights."""
    seq = packed_sequence_size or section.seq_length
    spans, weights = megatron_spans(section, vocab_size=tokenizer.vocab_size)
    common = dict(
        seq_length=seq,
        stride=seq,
        eos_token_id=tokenizer.eos_token_id,
        document_boundaries=packed_sequence_size > 0,
    )
    key = f"{section.SECTION}.paths"
    sizes = [len(TokenWindows([span], **common)) for span in spans]
    empty = [span for span, n in zip(spans, sizes) if n == 0]
    if len(empty) == len(spans) or (weights is not None and empty):
        span = empty[0]
        raise ConfigError(
            key,
            span.name,
            f"has {span.num_tokens} tokens in split {section.split_name!r}: fewer than one sample "
            f"of seq_length + 1 = {seq + 1} (an empty corpus or split)",
        )
    if weights is None:
        ds: Any = TokenWindows(spans, **common)
    else:
        parts = [TokenWindows([s], **common) for s in spans]
        total = section.num_samples or sum(len(p) for p in parts)
        ds = BlendedSamples(
            parts,
            counts=blend_counts(weights, total=total),
            seed=section.seed if section.seed is not None else seed,
        )
    ds.sample_order = ShuffledOrder(len(ds), seed=seed)
    return ds


def check_megatron_paths(section: MegatronPretrainingSection) -> None:
    megatron_spans(section, vocab_size=None)


# ---- nanoGPT -------------------------------------------------------------------------------------
def nanogpt_files(section: NanogptSection) -> list[str]:
    key = f"{section.SECTION}.file_pattern"
    patterns = [section.file_pattern] if isinstance(section.file_pattern, str) else section.file_pattern
    files: list[str] = []
    for pattern in patterns:
        p = str(Path(pattern).expanduser())
        found = sorted(glob.glob(p)) if glob.has_magic(p) else [p]
        found = [f for f in found if Path(f).is_file()]
        if not found:
            raise ConfigError(key, pattern, "matches no files" if glob.has_magic(p) else "does not exist")
        files += found
    return files


def bos_starts(shard: NanogptShard, *, bos_token: int, window: int, chunk: int = 1 << 24) -> np.ndarray:
    """Window starts at BOS tokens, each the first BOS at or after the previous window's end."""
    bos_idx = Path(str(shard.path)[: -len(".bin")] + ".bos.idx") if str(shard.path).endswith(".bin") else None
    if bos_idx is not None and bos_idx.is_file():
        positions = np.fromfile(bos_idx, dtype=np.int32).astype(np.int64)
    else:
        found = [
            np.flatnonzero(shard.tokens(i, min(i + chunk, shard.num_tokens)) == bos_token) + i
            for i in range(0, shard.num_tokens, chunk)
        ]
        positions = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    starts = []
    j = 0
    while j < len(positions) and positions[j] + window <= shard.num_tokens:
        starts.append(int(positions[j]))
        j = int(np.searchsorted(positions, positions[j] + window, side="left"))
    return np.asarray(starts, dtype=np.int64)


def build_nanogpt(section: NanogptSection, tokenizer: Any, *, packed_sequence_size: int, seed: int) -> Any:
    """Consecutive windows of ``seq_len + 1`` tokens per shard; shard order shuffled per epoch if asked."""
    key = f"{section.SECTION}.file_pattern"
    seq = packed_sequence_size or section.seq_len
    spans = []
    for f in nanogpt_files(section):
        shard = _open(NanogptShard, f, key=key)
        check_vocab_fits(dtype=shard.dtype, vocab_size=tokenizer.vocab_size, path=f, key=key)
        starts = (
            bos_starts(shard, bos_token=section.bos_token, window=seq + 1) if section.align_to_bos else None
        )
        spans.append(TokenSpan(source=shard, start=0, stop=shard.num_tokens, name=f, starts=starts))
    ds = TokenWindows(
        spans,
        seq_length=seq,
        stride=seq + 1,
        eos_token_id=tokenizer.eos_token_id,
        document_boundaries=packed_sequence_size > 0,
    )
    if len(ds) == 0:
        raise ConfigError(key, section.file_pattern, f"holds no sample of seq_len + 1 = {seq + 1} tokens")
    ds.sample_order = (
        BlockShuffledOrder(ds.span_sizes.tolist(), seed=seed)
        if section.shuffle_files
        else SequentialOrder(len(ds))
    )
    return ds


def check_nanogpt_paths(section: NanogptSection) -> None:
    for f in nanogpt_files(section):
        _open(NanogptShard, f, key=f"{section.SECTION}.file_pattern")
