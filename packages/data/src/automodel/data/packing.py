"""Pack tokenized documents into fixed-length rows, keeping document boundaries.

Documents are joined with EOS and cut into rows of ``seq_length + 1`` tokens (inputs are the
first ``seq_length``, labels the last). With document boundaries on, each row also carries
position ids that restart at 0 after every EOS, which transformers turns into a block-causal
mask (packed sequences) and which packed-sequence CP shards along with the tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def packed_row_count(num_tokens: int, *, seq_length: int) -> int:
    """The rows of ``seq_length + 1`` tokens that `num_tokens` fill (the tail that fills none is dropped)."""
    return num_tokens // (seq_length + 1)


class PackedDataset:
    """Rows of ``seq_length + 1`` tokens; ``row(i)`` -> (input_ids, labels, position_ids)."""

    def __init__(
        self, tokens: torch.Tensor, *, seq_length: int, eos_token_id: int, document_boundaries: bool
    ) -> None:
        assert tokens.dim() == 1
        self.seq_length = seq_length
        self.eos_token_id = eos_token_id
        self.document_boundaries = document_boundaries
        n = packed_row_count(tokens.numel(), seq_length=seq_length)
        self.rows = tokens[: n * (seq_length + 1)].view(n, seq_length + 1)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = self.rows[torch.as_tensor(indices, dtype=torch.long)]
        return split_rows(rows, eos_token_id=self.eos_token_id, document_boundaries=self.document_boundaries)


def split_rows(
    rows: torch.Tensor, *, eos_token_id: int, document_boundaries: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``seq_length + 1`` tokens -> (input_ids, labels, position_ids), positions restarting
    after each EOS when `document_boundaries` (the packed-row mechanism every dataset shares)."""
    input_ids, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    if document_boundaries:
        position_ids = document_position_ids(input_ids, eos_token_id)
    else:
        position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids).contiguous()
    return input_ids, labels, position_ids


def document_position_ids(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Positions that restart at 0 on the token after each EOS (per row)."""
    b, s = input_ids.shape
    idx = torch.arange(s).expand(b, s)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_token_id
    start_idx = torch.where(starts, idx, torch.zeros_like(idx))
    last_start = torch.cummax(start_idx, dim=1).values
    return idx - last_start


def pack_documents(docs: Iterable[list[int]], *, eos_token_id: int) -> torch.Tensor:
    """Concatenate token lists with an EOS after each document."""
    flat: list[int] = []
    for ids in docs:
        flat.extend(ids)
        flat.append(eos_token_id)
    return torch.tensor(flat, dtype=torch.long)
