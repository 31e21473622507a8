"""Checksums of every checkpoint file: written at save, verified before a load.

File sizes catch a truncated file, not same-size garbage nor a shard copied in from another step
(which used to end in a bare ``JSONDecodeError`` or a dozen tracebacks). ``checkpoint.json`` now
lists a sha256 per file; the ranks hash a share each (files round-robin by sorted name) and rank 0
writes the merged map. Before a resume the ranks verify their shares the same way; a mismatch names
the file, and with ``checkpoint.on_corrupt: previous`` the run falls back to the newest older
checkpoint that verifies (saying so), else it stops naming that checkpoint as the way on.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from automodel.recipes.checkpoint import paths
from automodel.recipes.checkpoint.paths import CheckpointError

log = logging.getLogger(__name__)

CHECKSUMS_KEY = "sha256"
_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _share(names: list[str]) -> list[str]:
    """This rank's share of `names` (sorted, round-robin), so hashing runs on every rank at once."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return sorted(names)[rank::world]


def _merge(part: dict) -> dict:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return part
    gathered: list[dict] = [{}] * dist.get_world_size()
    dist.all_gather_object(gathered, part)
    return {k: v for g in gathered for k, v in g.items()}


def _from_rank0(obj: list[Path]) -> list[Path]:
    """Rank 0's directory listing on every rank: every rank then verifies the same candidates."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_checksums(directory: Path, files: list[str]) -> dict[str, str]:
    """sha256 of every file in `files` (relative to `directory`). Collective."""
    return _merge({name: sha256_file(directory / name) for name in _share(files)})


def corrupt_files(path: Path, info: dict) -> list[str]:
    """Files of checkpoint `path` whose sha256 differs from ``checkpoint.json`` (with why). Collective.

    A checkpoint written before checksums existed has none to verify: only its sizes were checked.
    """
    expected = info.get(CHECKSUMS_KEY)
    if not isinstance(expected, dict):
        return []
    bad = {}
    for name in _share(list(expected)):
        try:
            got = sha256_file(path / name)
        except OSError as e:
            bad[name] = f"{path / name}: unreadable ({e.strerror or e})"
            continue
        if got != expected[name]:
            bad[name] = (
                f"{path / name}: sha256 {got[:12]}... differs from the saved {str(expected[name])[:12]}..."
            )
    return sorted(_merge(bad).values())


def verified(path: Path, *, root: Path, on_corrupt: str, explicit: bool) -> Path:
    """`path` when its files match their checksums; else the fallback `on_corrupt` allows. Collective.

    With ``on_corrupt == "previous"`` and no explicit ``restore_from``, the newest older complete
    checkpoint that verifies is taken (one line says which and why); otherwise `CheckpointError`
    names the bad files and the checkpoint to resume from instead.
    """
    info = paths.check_complete(path)
    bad = corrupt_files(path, info)
    if not bad:
        return path
    older = _from_rank0([p for s, p in reversed(paths.list_step_dirs(root)) if s < info["step"]])
    for candidate in older:
        try:
            candidate_info = paths.check_complete(candidate)
        except CheckpointError:
            continue
        if corrupt_files(candidate, candidate_info):
            continue
        if on_corrupt == "previous" and not explicit:
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(
                    f"checkpoint {path} is corrupt ({'; '.join(bad)}); resuming from the previous complete "
                    f"checkpoint {candidate} instead (checkpoint.on_corrupt: previous)",
                    file=sys.stderr,
                    flush=True,
                )
            return candidate
        raise CheckpointError(
            f"checkpoint {path} is corrupt: {'; '.join(bad)}. The previous complete checkpoint is {candidate}: "
            f"resume from it with checkpoint.restore_from: {candidate} (or checkpoint.on_corrupt: previous)"
        )
    raise CheckpointError(
        f"checkpoint {path} is corrupt: {'; '.join(bad)}; no older complete checkpoint verifies"
    )
