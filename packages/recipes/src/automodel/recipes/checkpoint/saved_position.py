"""The data position a checkpoint holds, read by the `recipes` launcher before any rank starts.

Every rank saves the same global position (`automodel.data.sampler`: epoch, batch in epoch, seed,
rows, global batch size) in its ``extra_rank<r>`` entry; rank 0's is the one a resume on another
world size restores. Reading it is one small DCP entry, through the restricted readers of
`safe_dcp`, in a process without a process group.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp

from automodel.recipes.checkpoint.paths import CheckpointError, newest_complete, resolve_restore_spec
from automodel.recipes.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from automodel.recipes.checkpoint.state import EXTRA_PREFIX, decode_extra, extra_placeholders, has_extra


def restored_checkpoint(root: Path, *, restore_from: str | None) -> Path | None:
    """The checkpoint a run resumes from, as its ranks choose it: ``checkpoint.restore_from``,
    else the newest complete one under `root` (None: a fresh start, or a choice that
    `preflight.check_restore_from` refuses)."""
    try:
        if restore_from is None:
            return newest_complete(root, announce_skipped=False)
        return resolve_restore_spec(root, restore_from)
    except CheckpointError:
        return None


def saved_data_position(path: Path) -> dict[str, Any] | None:
    """Rank 0's dataloader state in checkpoint `path` (None when it holds none)."""
    reader = SafeFileSystemReader(str(path))
    metadata = reader.read_metadata()
    key = f"{EXTRA_PREFIX}0"
    if not has_extra(metadata, key):
        return None
    loaded = {key: extra_placeholders(metadata, key)}
    with warnings.catch_warnings():  # torch warns that one process loads: the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(loaded, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    state = decode_extra(loaded[key]).get("dataloader")
    return state if isinstance(state, dict) else None
