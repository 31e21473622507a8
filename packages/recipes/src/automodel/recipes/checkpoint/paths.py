"""Checkpoint directory layout: naming, completeness checks, ``LATEST``, atomic publish, retention.

``<checkpoint_dir>/step_<N>/`` is published by renaming ``.tmp-step_<N>`` once every rank has
written; ``checkpoint.json`` inside is written last before the rename. ``LATEST`` is replaced
atomically after the rename. Anything whose name starts with ``.`` is never a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

LATEST_FILE = "LATEST"
INFO_FILE = "checkpoint.json"
DCP_METADATA_FILE = ".metadata"
CONSOLIDATED_DIR = "consolidated"
ADAPTER_DIR = "adapter"  # LoRA runs: Hugging Face PEFT adapter_config.json + adapter_model.safetensors
_STEP_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, partial or corrupt."""


def checkpoint_root(*, checkpoint_dir: str | None, output_dir: str | Path) -> Path:
    """Where a run's checkpoints live: ``checkpoint.checkpoint_dir``, else ``<output_dir>/checkpoints``."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(output_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def parse_step(name: str) -> int | None:
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def check_complete(path: Path) -> dict:
    """Return the checkpoint's info, or raise `CheckpointError` saying what is wrong with it."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
    info_path = path / INFO_FILE
    if not info_path.is_file():
        raise CheckpointError(f"checkpoint {path} is partial: {INFO_FILE} is missing")
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} is corrupt: {INFO_FILE} is unreadable ({err})") from err
    if not isinstance(info, dict) or not isinstance(info.get("step"), int):
        raise CheckpointError(f"checkpoint {path} is corrupt: {INFO_FILE} has no integer 'step'")
    files = info.get("files")
    if not isinstance(files, dict) or DCP_METADATA_FILE not in files:
        raise CheckpointError(f"checkpoint {path} is corrupt: {INFO_FILE} lists no files")
    missing = sorted(f for f in files if not (path / f).exists())
    if missing:
        raise CheckpointError(f"checkpoint {path} is partial: missing {', '.join(missing)}")
    odd = sorted(f for f in files if not (path / f).is_file())  # a directory, a FIFO: never saved so
    if odd:
        raise CheckpointError(f"checkpoint {path} is corrupt: {path / odd[0]} is not a regular file")
    wrong = sorted(f for f, size in files.items() if (path / f).stat().st_size != size)
    if wrong:
        raise CheckpointError(f"checkpoint {path} is corrupt: wrong size of {', '.join(wrong)}")
    return info


def file_sizes(path: Path) -> dict[str, int]:
    """Relative path -> size in bytes of every file under `path`."""
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def list_step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Published step directories in ascending step order (complete or not)."""
    if not root.is_dir():
        return []
    found = [(parse_step(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def newest_complete(root: Path, *, announce_skipped: bool = True) -> Path | None:
    """The highest-step complete checkpoint; incomplete ones are skipped with a log line (not when
    the pre-launch check looks: the ranks that resume say it once)."""
    for step, path in reversed(list_step_dirs(root)):
        try:
            check_complete(path)
        except CheckpointError as err:
            if announce_skipped:
                log.warning("skipping checkpoint step %d: %s", step, err)
            continue
        return path
    return None


def read_latest(root: Path) -> Path:
    latest = root / LATEST_FILE
    if not latest.is_file():
        raise CheckpointError(f"checkpoint.restore_from='LATEST' but {latest} does not exist")
    name = latest.read_text().strip()
    if not name or "/" in name or parse_step(name) is None:
        raise CheckpointError(f"{latest} is corrupt: it holds {name!r}, not a step directory name")
    return root / name


def resolve_restore_spec(root: Path, spec: str) -> Path:
    """The directory ``checkpoint.restore_from`` names: ``LATEST``, a step name under `root`, or a path."""
    if spec == LATEST_FILE:
        return read_latest(root)
    if parse_step(spec) is not None and (root / spec).exists():
        return root / spec
    return Path(spec)


def write_latest(root: Path, name: str) -> None:
    """Point ``LATEST`` at `name` atomically (write a temp file, fsync, rename)."""
    tmp = root / f"{TMP_PREFIX}{LATEST_FILE}"
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_FILE)
    _fsync_dir(root)


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a fully written temp dir to its final name; an older dir of that name is replaced."""
    trash = None
    if final_dir.exists():
        trash = final_dir.with_name(f"{TRASH_PREFIX}{final_dir.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final_dir, trash)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def remove_stale(root: Path) -> None:
    """Delete temp/trash dirs left by a crashed save (never a published checkpoint)."""
    if not root.is_dir():
        return
    for p in root.iterdir():
        if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            log.warning("removing %s left by an interrupted save", p)
            if p.is_dir() and not p.is_symlink():  # a link is removed itself, never its target
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)


def apply_retention(root: Path, keep_last_n: int) -> list[Path]:
    """Delete all but the newest `keep_last_n` step dirs; the one ``LATEST`` names always stays."""
    keep_name = (root / LATEST_FILE).read_text().strip() if (root / LATEST_FILE).is_file() else None
    dirs = list_step_dirs(root)
    removed = []
    for _, path in dirs[: max(0, len(dirs) - keep_last_n)]:
        if path.name == keep_name:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
