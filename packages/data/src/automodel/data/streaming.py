"""Streaming pretraining data: HF ``datasets`` streaming over local files, tokenised into packed windows.

Each dp rank opens ``split_dataset_by_node(stream, rank=dp_rank, world_size=dp_size)`` (whole files
per rank when the file count divides the dp size, else every dp-th document), so no two dp ranks
read the same document. Documents become ``[BOS] ids EOS`` (BOS where the tokenizer adds one, as
``recipes preprocess`` writes them) and a token buffer is cut into windows of ``seq_length + 1``
tokens with stride ``seq_length``. A step takes ``global_batch_size / dp`` windows on every rank.

The loader's state is the stream's own ``IterableDataset.state_dict()`` (after the documents read
so far), the tokens read but not yet used, the epoch, and (dp rank, dp size). It is saved per rank
in the checkpoint, so a resume with the same dp size continues exactly; another dp size would
split the documents differently, so it is refused. At the end of a rank's share the stream is
reopened (next epoch) from its first document.
"""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from automodel.data.batches import Batch
from automodel.data.errors import ConfigError, optional
from automodel.data.packing import PackedDataset, split_rows
from automodel.data.preprocess_worker import encode_batch
from automodel.data.streaming_section import FORMATS, StreamingSection
from automodel.data.tokenizer import bos_prefix

#: documents tokenised per tokenizer call
BATCH_DOCS = 16


def stream_files(section: StreamingSection) -> tuple[list[str], str]:
    """The section's files (sorted per entry) and the ``datasets`` builder that reads them."""
    key = f"{section.SECTION}.path"
    files: list[str] = []
    for entry in section.paths:
        p = Path(entry).expanduser()
        if p.is_dir():
            found = sorted(str(f) for f in p.iterdir() if f.suffix in FORMATS)
        elif glob.has_magic(str(p)):
            found = sorted(f for f in glob.glob(str(p)) if Path(f).is_file())
        else:
            found = [str(p)] if p.is_file() else []
        if not found:
            raise ConfigError(
                key, entry, "matches no files" if not p.exists() or p.is_dir() else "is not a file"
            )
        files += found
    if section.format is not None:
        return files, section.format
    builders = {FORMATS.get(Path(f).suffix) for f in files}
    if None in builders or len(builders) != 1:
        raise ConfigError(
            key,
            section.path,
            f"holds files of {sorted(Path(f).suffix for f in files)}: set {section.SECTION}.format "
            "(json, parquet or text) for one format",
        )
    return files, builders.pop() or "json"


def check_streaming_paths(section: StreamingSection) -> None:
    stream_files(section)


def open_stream(section: StreamingSection, *, dp_rank: int, dp_size: int, state: dict | None = None) -> Any:
    """This dp rank's share of the stream, at `state` (from its ``state_dict()``) when given."""
    datasets = optional("datasets", needed_for="source: streaming")
    split_dataset_by_node = optional(
        "datasets.distributed", needed_for="source: streaming"
    ).split_dataset_by_node

    files, builder = stream_files(section)
    try:
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True)
    except Exception as e:  # noqa: BLE001 - a file datasets cannot open is a config problem
        raise ConfigError(
            f"{section.SECTION}.path", section.path, f"cannot be read as {builder} ({type(e).__name__}: {e})"
        ) from None
    if dp_size > 1:
        ds = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_size)
    if state is not None:
        ds.load_state_dict(state)
    return ds


class TokenStream:
    """Windows of ``seq_length + 1`` tokens from one dp rank's share, resumable."""

    def __init__(
        self, section: StreamingSection, tokenizer: Any, *, seq_length: int, dp_rank: int, dp_size: int
    ) -> None:
        self.section, self.tokenizer = section, tokenizer
        self.seq_length, self.dp_rank, self.dp_size = seq_length, dp_rank, dp_size
        self.text_key = "text" if stream_files(section)[1] == "text" else section.text_key
        self.bos = (bos_prefix(tokenizer) or [None])[0]
        self.epoch = 0
        self.buffer = np.zeros(0, dtype=np.int64)
        self._open(None)

    def _open(self, state: dict | None) -> None:
        self.ds = open_stream(self.section, dp_rank=self.dp_rank, dp_size=self.dp_size, state=state)
        self._it: Iterator[dict] = iter(self.ds)
        self._read_this_epoch = 0

    def _texts(self) -> list[str]:
        """Up to `BATCH_DOCS` non-empty texts; at the end of the share, the next epoch's."""
        texts: list[str] = []
        while len(texts) < BATCH_DOCS:
            try:
                row = next(self._it)
            except StopIteration:
                if texts:
                    return texts
                if self._read_this_epoch == 0:
                    raise ConfigError(
                        f"{self.section.SECTION}.path",
                        self.section.path,
                        f"gives dp rank {self.dp_rank} of {self.dp_size} no document with text",
                    ) from None
                self.epoch += 1
                self._open(None)
                continue
            if self.text_key not in row:
                raise ConfigError(
                    f"{self.section.SECTION}.text_key",
                    self.text_key,
                    f"is not a column; columns: {', '.join(row)}",
                )
            text = row[self.text_key]
            if isinstance(text, str) and text:
                texts.append(text)
                self._read_this_epoch += 1
        return texts

    def _fill(self, need: int) -> None:
        pieces = [self.buffer]
        have = self.buffer.shape[0]
        eos = self.tokenizer.eos_token_id
        while have < need:
            for ids in encode_batch(self.tokenizer, self._texts()):
                doc = np.asarray(ids, dtype=np.int64)
                parts = [doc, np.array([eos], dtype=np.int64)]
                if self.bos is not None:
                    parts.insert(0, np.array([self.bos], dtype=np.int64))
                pieces += parts
                have += doc.shape[0] + len(parts) - 1
        self.buffer = np.concatenate(pieces)

    def windows(self, n: int) -> np.ndarray:
        """The next `n` windows, ``[n, seq_length + 1]``."""
        seq = self.seq_length
        self._fill(n * seq + 1)
        rows = np.lib.stride_tricks.sliding_window_view(self.buffer[: n * seq + 1], seq + 1)[::seq]
        out = np.array(rows[:n])
        self.buffer = self.buffer[n * seq :]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "stream": self.ds.state_dict(),
            "buffer": self.buffer.tolist(),
            "epoch": self.epoch,
            "read_this_epoch": self._read_this_epoch,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("dp_rank"), state.get("dp_size")) != (self.dp_rank, self.dp_size):
            raise ConfigError(
                f"{self.section.SECTION}.source",
                "streaming",
                f"cannot resume exactly on dp rank {self.dp_rank} of {self.dp_size}: the checkpoint's "
                f"stream position is dp rank {state.get('dp_rank')} of {state.get('dp_size')}'s share "
                "(a streaming dataset is split by dp rank; resume with the same dp size, or preprocess "
                "the corpus with `recipes preprocess` for resumes across world sizes)",
            )
        self.epoch = int(state["epoch"])
        self._open(state["stream"])
        self._read_this_epoch = int(state["read_this_epoch"])
        self.buffer = np.asarray(state["buffer"], dtype=np.int64)


class StreamingLoader:
    """Per step: this dp rank's ``global_batch_size / dp`` windows as micro-batches; checkpointable."""

    steps_per_epoch = None  # unknown: a stream has no length (``step_scheduler.max_steps`` sets the run)

    def __init__(
        self,
        stream: TokenStream,
        *,
        global_batch_size: int,
        local_batch_size: int,
        eos_token_id: int,
        document_boundaries: bool,
    ) -> None:
        dp = stream.dp_size
        if global_batch_size % (local_batch_size * dp):
            raise ValueError(
                f"global_batch_size={global_batch_size} must be a multiple of local_batch_size*dp = "
                f"{local_batch_size}*{dp}"
            )
        self.stream = stream
        self.per_rank, self.local_batch_size = global_batch_size // dp, local_batch_size
        self.eos_token_id, self.document_boundaries = eos_token_id, document_boundaries

    def next_step(self) -> list[Batch]:
        rows = torch.from_numpy(self.stream.windows(self.per_rank))
        lb = self.local_batch_size
        return [
            Batch(
                *split_rows(
                    rows[i : i + lb],
                    eos_token_id=self.eos_token_id,
                    document_boundaries=self.document_boundaries,
                )
            )
            for i in range(0, self.per_rank, lb)
        ]

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)


class StreamingDataset:
    """What the streaming kind builds for training: a factory of per-rank loaders (`loader`)."""

    def __init__(
        self, section: StreamingSection, tokenizer: Any, *, seq_length: int, document_boundaries: bool
    ) -> None:
        self.section, self.tokenizer = section, tokenizer
        self.seq_length, self.document_boundaries = seq_length, document_boundaries

    def loader(
        self, *, global_batch_size: int, local_batch_size: int, dp_rank: int, dp_size: int
    ) -> StreamingLoader:
        stream = TokenStream(
            self.section, self.tokenizer, seq_length=self.seq_length, dp_rank=dp_rank, dp_size=dp_size
        )
        return StreamingLoader(
            stream,
            global_batch_size=global_batch_size,
            local_batch_size=local_batch_size,
            eos_token_id=self.tokenizer.eos_token_id,
            document_boundaries=self.document_boundaries,
        )


def build_streaming(
    section: StreamingSection, tokenizer: Any, *, packed_sequence_size: int, seed: int
) -> Any:
    """Training: a `StreamingDataset` (each rank opens its share in `loader`). Validation: the first
    ``max_rows`` windows of the whole stream, in memory (every rank the same rows)."""
    seq = packed_sequence_size or section.seq_length
    boundaries = packed_sequence_size > 0
    if section.SECTION == "dataset":
        stream_files(section)
        return StreamingDataset(section, tokenizer, seq_length=seq, document_boundaries=boundaries)
    stream = TokenStream(section, tokenizer, seq_length=seq, dp_rank=0, dp_size=1)
    rows = []
    while len(rows) < section.max_rows:
        row = stream.windows(1)
        if stream.epoch > 0:  # one pass at most: the windows of a short stream are not repeated
            break
        rows.append(row)
    return PackedDataset(
        torch.from_numpy(np.concatenate(rows)).reshape(-1) if rows else torch.zeros(0, dtype=torch.long),
        seq_length=seq,
        eos_token_id=tokenizer.eos_token_id,
        document_boundaries=boundaries,
    )
