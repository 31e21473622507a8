"""Build the memory-mapped pretraining datasets from their sections (and check their files first).

Every corpus is opened (O(1): headers and sizes) before any sample is read, so a missing,
truncated or mismatched file, a shard dtype too small for the tokenizer, or an empty split is a
`ConfigError` naming the key and the file, raised in the launching process.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from automodel.data.blend import MID_LEVEL_SURPLUS, BlendedSamples
from automodel.data.blend_indices import blending_indices, normalize, size_per_dataset
from automodel.data.corpus_error import CorpusError
from automodel.data.errors import ConfigError
from automodel.data.index_cache import cached_arrays
from automodel.data.megatron_corpus import MegatronCorpus
from automodel.data.megatron_order import GptOrder, gpt_order, gpt_sample_count
from automodel.data.megatron_paths import resolve_blend, split_range
from automodel.data.megatron_samples import MegatronSamples
from automodel.data.nanogpt_shard import NanogptShard
from automodel.data.pretrain_sections import MegatronPretrainingSection, NanogptSection, parse_split
from automodel.data.sample_order import BlockShuffledOrder, SequentialOrder, StoredThenShuffledOrder
from automodel.data.sections import DataSection
from automodel.data.token_windows import TokenSpan, TokenWindows


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
@dataclass(frozen=True)
class CorpusSplit:
    """One corpus and the documents ``[first, stop)`` of it this split reads."""

    corpus: MegatronCorpus
    first: int
    stop: int
    name: str

    @property
    def num_tokens(self) -> int:
        start, end = self.corpus.sequence_token_range(self.first, self.stop)  # O(1): from the pointers
        return end - start


def megatron_splits(
    section: MegatronPretrainingSection, *, vocab_size: int | None
) -> tuple[list[CorpusSplit], list[float] | None]:
    """Each corpus's documents for ``splits_to_build`` (megatron-core's split), and the blend weights."""
    key = f"{section.SECTION}.paths"
    split_name = section.split_name
    prefixes, weights, uses_split = resolve_blend(section.paths, split_name=split_name, key=key)
    ratios = parse_split(section.split, key=f"{section.SECTION}.split")
    out = []
    for prefix in prefixes:
        corpus = _open(MegatronCorpus, prefix, key=key)
        check_vocab_fits(dtype=corpus.dtype, vocab_size=vocab_size, path=str(corpus.bin_path), key=key)
        first, stop = (
            split_range(corpus.num_sequences, ratios, split_name) if uses_split else (0, corpus.num_sequences)
        )
        out.append(CorpusSplit(corpus=corpus, first=first, stop=stop, name=prefix))
    return out, weights


def _gpt_samples(
    part: CorpusSplit,
    *,
    section: MegatronPretrainingSection,
    seq: int,
    seed: int,
    num_samples: int | None,
    eos_token_id: int,
    document_boundaries: bool,
) -> MegatronSamples:
    """megatron-core's ``GPTDataset`` over `part` (its order cached in ``index_mapping_dir``)."""
    idx = part.corpus.index.path
    description = {
        "corpus": str(Path(part.corpus.prefix).resolve()),
        "idx_bytes": idx.stat().st_size,
        "idx_mtime_ns": idx.stat().st_mtime_ns,
        "documents": [part.first, part.stop],
        "seq_length": seq,
        "seed": seed,
        "num_samples": num_samples,
    }

    def build() -> dict[str, np.ndarray]:
        order = gpt_order(
            part.corpus.index.lengths,
            first=part.first,
            stop=part.stop,
            seq_length=seq,
            seed=seed,
            num_samples=num_samples,
        )
        return {
            "document_index": order.document_index,
            "document_starts": order.document_starts,
            "shuffle_index": order.shuffle_index,
        }

    arrays = cached_arrays(
        section.index_mapping_dir,
        kind=f"GPTDataset-{section.split_name}",
        description=description,
        build=build,
    )
    return MegatronSamples(
        part.corpus,
        GptOrder(**arrays),
        seq_length=seq,
        eos_token_id=eos_token_id,
        document_boundaries=document_boundaries,
        name=part.name,
    )


def build_megatron(
    section: MegatronPretrainingSection, tokenizer: Any, *, packed_sequence_size: int, seed: int
) -> Any:
    """megatron-core's ``GPTDataset`` (one corpus) or ``BlendedDataset`` (several) for the split,
    built as ``BlendedMegatronDatasetBuilder`` builds them, so position ``i`` is their sample ``i``
    token for token. The training sampler reads that order for the first epoch, then reshuffles."""
    seq = packed_sequence_size or section.seq_length
    parts, weights = megatron_splits(section, vocab_size=tokenizer.vocab_size)
    data_seed = section.seed if section.seed is not None else seed
    _check_parts_hold_a_sample(parts, seq=seq, section=section)
    size = section.num_samples

    def gpt(part: CorpusSplit, num_samples: int | None) -> MegatronSamples:
        return _gpt_samples(
            part,
            section=section,
            seq=seq,
            seed=data_seed,
            num_samples=num_samples,
            eos_token_id=tokenizer.eos_token_id,
            document_boundaries=packed_sequence_size > 0,
        )

    if len(parts) == 1 and weights is None:
        ds: Any = gpt(parts[0], size)
    else:
        ds = _blend(parts, weights, size=size, seq=seq, gpt=gpt, section=section)
    ds.sample_order = StoredThenShuffledOrder(len(ds), seed=seed)
    return ds


def _check_parts_hold_a_sample(
    parts: list[CorpusSplit], *, seq: int, section: MegatronPretrainingSection
) -> None:
    for part in parts:
        if part.num_tokens < seq + 1:
            raise ConfigError(
                f"{section.SECTION}.paths",
                part.name,
                f"has {part.num_tokens} tokens in split {section.split_name!r}: fewer than one sample "
                f"of seq_length + 1 = {seq + 1} (an empty corpus or split)",
            )


def _one_pass_samples(part: CorpusSplit, *, seq: int) -> int:
    """The samples of one pass over `part` (its `_gpt_samples` without a sample count)."""
    return gpt_sample_count(tokens_per_epoch=part.num_tokens, seq_length=seq, num_samples=None)


def _weighted_size(size: int | None, *, parts: list[CorpusSplit], seq: int) -> int:
    """A weighted blend's sample count: `size`, else (megatron-core refuses none) the samples one
    pass over every corpus gives."""
    return size if size is not None else sum(_one_pass_samples(p, seq=seq) for p in parts)


def megatron_length(section: MegatronPretrainingSection, *, vocab_size: int | None, seq: int) -> int:
    """`build_megatron`'s length without building a sample order: from the ``.idx`` headers and
    pointers (O(corpora)); an empty split is refused as `build_megatron` refuses it."""
    parts, weights = megatron_splits(section, vocab_size=vocab_size)
    _check_parts_hold_a_sample(parts, seq=seq, section=section)
    size = section.num_samples
    if len(parts) == 1 and weights is None:
        return gpt_sample_count(tokens_per_epoch=parts[0].num_tokens, seq_length=seq, num_samples=size)
    if weights is not None:  # the blend's size: its corpora's targets
        return sum(size_per_dataset(normalize(weights), size=_weighted_size(size, parts=parts, seq=seq)))
    total = sum(_one_pass_samples(p, seq=seq) for p in parts)
    return total if size is None else min(size, total)


def _blend(
    parts: list[CorpusSplit],
    weights: list[float] | None,
    *,
    size: int | None,
    seq: int,
    gpt: Any,
    section: MegatronPretrainingSection,
) -> BlendedSamples:
    """``BlendedMegatronDatasetBuilder``'s blend of `parts`. With weights and no sample count (which
    megatron-core refuses), the count is the samples one pass over every corpus gives."""
    if weights is not None:
        w = normalize(weights)
        size = _weighted_size(size, parts=parts, seq=seq)
        targets = size_per_dataset(w, size=size)
        margins = size_per_dataset(w, size=size, surplus=MID_LEVEL_SURPLUS)
        sets = [gpt(p, n) for p, n in zip(parts, margins)]
        blend_w, blend_size, caps = normalize(w), sum(targets), None
    else:
        sets = [gpt(p, None) for p in parts]
        lengths = [len(s) for s in sets]
        if size is None:
            total = sum(lengths)
            blend_w, blend_size, caps = [n / float(total) for n in lengths], total, lengths
        else:
            blend_w, blend_size, caps = normalize(lengths), min(size, sum(lengths)), None
    description = {
        "parts": [[str(Path(p.corpus.prefix).resolve()), len(s)] for p, s in zip(parts, sets)],
        "weights": blend_w,
        "size": blend_size,
        "caps": caps,
    }
    arrays = cached_arrays(
        section.index_mapping_dir,
        kind=f"BlendedDataset-{section.split_name}",
        description=description,
        build=lambda: dict(
            zip(
                ("dataset_index", "dataset_sample_index"),
                blending_indices(blend_w, size=blend_size, caps=caps),
                strict=True,
            )
        ),
    )
    ds = BlendedSamples(sets, **arrays)
    for d, n in enumerate(ds.counts.tolist()):
        if n > len(sets[d]):
            raise ConfigError(
                f"{section.SECTION}.paths",
                parts[d].name,
                f"is asked for {n} samples of the blend but its split gives {len(sets[d])}",
            )
    return ds


def count_megatron_rows(
    section: MegatronPretrainingSection,
    tokenizer: Any,
    *,
    packed_sequence_size: int,
    seed: int,
    at_least: int,
) -> int:
    """`build_megatron`'s samples, counted before launch (`megatron_length`: no order is built)."""
    seq = packed_sequence_size or section.seq_length
    return megatron_length(section, vocab_size=tokenizer.vocab_size, seq=seq)


def check_megatron_paths(section: MegatronPretrainingSection) -> None:
    megatron_splits(section, vocab_size=None)


def corpus_files(section: DataSection) -> list[tuple[str, Any]]:
    """``(file, its tokens)`` of a Megatron or nanoGPT section (``tokens(start, stop)``,
    ``num_tokens``, ``dtype``); none for other kinds."""
    if isinstance(section, MegatronPretrainingSection):
        parts, _ = megatron_splits(section, vocab_size=None)
        return [(str(p.corpus.bin_path), p.corpus) for p in parts]
    if isinstance(section, NanogptSection):
        key = f"{section.SECTION}.file_pattern"
        return [(f, _open(NanogptShard, f, key=key)) for f in nanogpt_files(section)]
    return []


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


def count_nanogpt_rows(
    section: NanogptSection, tokenizer: Any, *, packed_sequence_size: int, seed: int, at_least: int
) -> int:
    """`build_nanogpt`'s windows, counted before launch by building it (memory-mapped shards:
    headers and sizes, plus one scan for BOS tokens with ``align_to_bos`` and no ``.bos.idx``)."""
    return len(build_nanogpt(section, tokenizer, packed_sequence_size=packed_sequence_size, seed=seed))


def check_nanogpt_paths(section: NanogptSection) -> None:
    for f in nanogpt_files(section):
        _open(NanogptShard, f, key=f"{section.SECTION}.file_pattern")
