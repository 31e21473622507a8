"""megatron-core's ``GPTDataset`` sample order, in numpy: document index, sample windows, shuffle index.

For the documents ``[first, stop)`` of one corpus split, a seed and an optional sample count:

- ``num_epochs``: passes over the documents needed for ``num_samples`` windows (1 without a count);
- document index: the documents repeated ``num_epochs`` times and shuffled by
  ``numpy.random.RandomState(seed)``; when the last pass would give fewer than 80 % of an epoch's
  samples it is shuffled on its own (the "separate final epoch"), so a short last pass is not
  spread over the whole run;
- samples: sample ``k`` is tokens ``[k * seq_length, k * seq_length + seq_length + 1)`` of the
  documents concatenated in document-index order (megatron-core's ``build_sample_idx`` records the
  same windows as (document, offset) pairs), ``(num_epochs * tokens_per_epoch - 1) // seq_length``
  of them;
- shuffle index: a permutation of the samples by the same random state (the final epoch's
  samples, when separate, permuted among themselves after the others).

Dataset position ``i`` reads sample ``shuffle[i]``. The random state is consumed in the order
megatron-core consumes it, so the same corpus, split, seq_length, seed and count give the same
samples token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: megatron-core's threshold for shuffling a short final epoch on its own.
SEPARATE_FINAL_EPOCH_BELOW = 0.80


@dataclass(frozen=True)
class GptOrder:
    document_index: np.ndarray  # int32[num_epochs * documents]: document of each stream slot
    document_starts: np.ndarray  # int64[slots + 1]: stream token offset of each slot
    shuffle_index: np.ndarray  # permutation of range(num_samples)

    @property
    def num_samples(self) -> int:
        return int(self.shuffle_index.shape[0])


def num_epochs_for(*, tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    if num_samples is None:
        return 1
    wanted = num_samples * seq_length + 1  # + the extra token of the last window
    return max(1, -(-wanted // tokens_per_epoch))


def gpt_sample_count(*, tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> int:
    """The samples (dataset length) of the order `gpt_order` builds: ``(num_epochs * tokens_per_epoch
    - 1) // seq_length``, at least `num_samples` when given; O(1), so counted before launch too."""
    epochs = num_epochs_for(tokens_per_epoch=tokens_per_epoch, num_samples=num_samples, seq_length=seq_length)
    return max(0, (epochs * tokens_per_epoch - 1) // seq_length)


def _document_index(
    documents: np.ndarray, epochs: int, rng: np.random.RandomState, separate: bool
) -> np.ndarray:
    if separate and epochs > 1:
        head = _document_index(documents, epochs - 1, rng, False)
        return np.concatenate((head, _document_index(documents, 1, rng, False)))
    index = np.tile(documents.astype(np.int32), epochs)
    rng.shuffle(index)
    return index


def _shuffle_index(first: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(first, dtype=dtype)
    rng.shuffle(head)
    if first == total:
        return head
    tail = np.arange(first, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate((head, tail))


def gpt_order(
    lengths: np.ndarray, *, first: int, stop: int, seq_length: int, seed: int, num_samples: int | None
) -> GptOrder:
    """The order of documents ``first..stop-1`` (of `lengths` tokens each), as megatron-core builds it."""
    documents = np.arange(first, stop, dtype=np.int32)
    tokens_per_epoch = int(np.asarray(lengths[first:stop], dtype=np.int64).sum())
    epochs = num_epochs_for(tokens_per_epoch=tokens_per_epoch, num_samples=num_samples, seq_length=seq_length)
    separate = False
    sans_final = 0
    if epochs > 1:
        assert num_samples is not None
        sans_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - sans_final < int(SEPARATE_FINAL_EPOCH_BELOW * per_epoch)
    rng = np.random.RandomState(seed)
    doc_index = _document_index(documents, epochs, rng, separate)
    total = gpt_sample_count(
        tokens_per_epoch=tokens_per_epoch, seq_length=seq_length, num_samples=num_samples
    )
    starts = np.zeros(doc_index.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.asarray(lengths, dtype=np.int64)[doc_index], out=starts[1:])
    shuffle = _shuffle_index(sans_final if separate else total, total, rng)
    return GptOrder(document_index=doc_index, document_starts=starts, shuffle_index=shuffle)
