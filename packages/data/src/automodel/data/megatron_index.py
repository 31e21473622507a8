"""Megatron's indexed format: the ``.idx`` file, read memory-mapped and written.

Layout (megatron-core ``indexed_dataset``, little-endian)::

    b"MMIDIDX\\x00\\x00"  version <Q = 1  dtype code <B  sequence_count <Q  document_count <Q
    int32[sequence_count] sequence lengths (tokens)
    int64[sequence_count] sequence pointers (byte offset of each sequence in the .bin)
    int64[document_count] document indices (sequence index where each document starts, then the end)

The arrays are views of a memory map: opening a corpus reads 34 bytes whatever its size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from automodel.data.corpus_error import CorpusError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
#: megatron-core ``DType`` codes.
DTYPE_OF_CODE: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_OF_CODE.items()}
TOKEN_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32), np.dtype(np.int64))


@dataclass(frozen=True)
class MegatronIndex:
    """One ``.idx`` file: token dtype and memory-mapped per-sequence lengths and byte pointers."""

    path: Path
    dtype: np.dtype
    lengths: np.ndarray  # int32[sequences]
    pointers: np.ndarray  # int64[sequences]
    document_indices: np.ndarray  # int64[documents + 1]

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.shape[0])


def read_index(path: str | Path) -> MegatronIndex:
    """Memory-map `path`; `CorpusError` naming it when the header or its size is not a Megatron index."""
    path = Path(path)
    if not path.is_file():
        raise CorpusError(path, "does not exist (a Megatron corpus is <prefix>.bin + <prefix>.idx)")
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[: len(MAGIC)] != MAGIC:
        raise CorpusError(path, "is not a Megatron .idx file (no MMIDIDX header)")
    version, code, n_seq, n_doc = struct.unpack_from("<QBQQ", head, len(MAGIC))
    if version != VERSION:
        raise CorpusError(path, f"has index version {version}; only version {VERSION} is read")
    if code not in DTYPE_OF_CODE or DTYPE_OF_CODE[code] not in TOKEN_DTYPES:
        raise CorpusError(path, f"has token dtype code {code}, not an integer token type")
    expected = HEADER_BYTES + n_seq * (4 + 8) + n_doc * 8
    if size not in (expected, expected + n_seq):  # + int8 modes per sequence (multimodal)
        raise CorpusError(
            path, f"is {size} bytes; its header ({n_seq} sequences, {n_doc} document marks) needs {expected}"
        )
    mm = np.memmap(path, mode="r", dtype=np.uint8)
    lengths = np.frombuffer(mm, dtype=np.int32, count=n_seq, offset=HEADER_BYTES)
    pointers = np.frombuffer(mm, dtype=np.int64, count=n_seq, offset=HEADER_BYTES + 4 * n_seq)
    docs = np.frombuffer(mm, dtype=np.int64, count=n_doc, offset=HEADER_BYTES + 12 * n_seq)
    return MegatronIndex(
        path=path, dtype=DTYPE_OF_CODE[code], lengths=lengths, pointers=pointers, document_indices=docs
    )


def write_index(
    path: str | Path, *, dtype: np.dtype, lengths: np.ndarray, document_indices: np.ndarray
) -> None:
    """Write an ``.idx`` for sequences of `lengths` tokens stored back to back in the ``.bin``."""
    dtype = np.dtype(dtype)
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"token dtype {dtype} is not one of {[str(d) for d in TOKEN_DTYPES]}")
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(lengths.shape[0], dtype=np.int64)
    if lengths.shape[0] > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    with Path(path).open("wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<QBQQ", VERSION, CODE_OF_DTYPE[dtype], lengths.shape[0], docs.shape[0]))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(docs.tobytes())
