"""The files a run reads that a rank would otherwise meet as a traceback, checked before launch:
the pretrained model directory and the checkpoint the run restores (`preflight.check_run_files`).

Each refusal is a `ConfigError` naming the key and the file: unreadable, truncated, or of the wrong
kind (`file_kind.unreadable_file`; a ``.safetensors`` file that is not one; a DCP ``.metadata`` that
does not unpickle as DCP metadata).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from automodel.recipes.checkpoint.paths import DCP_METADATA_FILE, CheckpointError, check_complete
from automodel.recipes.checkpoint.pretrained import weight_files
from automodel.recipes.checkpoint.safe_dcp import load_metadata
from automodel.recipes.config.sections import ModelSection
from automodel.recipes.errors import ConfigError
from automodel.recipes.file_kind import read_json_object, unreadable_file

SAFETENSORS_INDEX = "model.safetensors.index.json"


def check_safetensors_files(directory: Path, *, key: str) -> None:
    """Every ``*.safetensors`` in `directory` is as long as its header says (not truncated)."""
    for path in sorted(directory.glob("*.safetensors")):
        problem = unreadable_file(path)
        if problem is not None:
            raise ConfigError(key, str(directory), f"{path} {problem}")
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size:
                    raise ValueError(f"its header claims {n} bytes")
                header = json.loads(f.read(n))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (OSError, ValueError, struct.error, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ConfigError(
                key, str(directory), f"{path} is not a readable safetensors file ({e})"
            ) from None
        if size != 8 + n + end:
            raise ConfigError(
                key,
                str(directory),
                f"{path} is truncated or corrupt: {size} bytes, its header needs {8 + n + end}",
            )


def check_model_dir(section: ModelSection, directory: Path) -> None:
    """`directory` (``model.pretrained_model_name_or_path``; its config.json: `model.pretrained_dir`)
    holds weights the run will load: safetensors of the length their headers say (and every shard
    its index names), or pickled weights only with ``model.allow_pickle_weights`` (`weight_files`)."""
    key, value = section.pretrained_key, str(directory)
    try:
        pickled = weight_files(directory, allow_pickle_weights=section.allow_pickle_weights)
    except ConfigError:
        raise
    except ValueError as e:  # no weights at all: the directory is the key's value
        raise ConfigError(key, value, str(e)) from None
    for path in pickled:  # read whole by every rank (torch.load): here only opened
        problem = unreadable_file(path)
        if problem is not None:
            raise ConfigError(key, value, f"{path} {problem}")
    if pickled:
        return
    check_safetensors_files(directory, key=key)
    index = directory / SAFETENSORS_INDEX
    if index.exists() or index.is_symlink():
        shards = read_json_object(index, key=key, value=value).get("weight_map")
        if not isinstance(shards, dict):
            raise ConfigError(key, value, f"{index} has no 'weight_map' object")
        for name in sorted(set(map(str, shards.values()))):
            problem = unreadable_file(directory / name)
            if problem is not None:
                raise ConfigError(key, value, f"{directory / name} (named by {index.name}) {problem}")


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint `path` cannot be restored, as far as reading it here can tell, or None:
    incomplete (`paths.check_complete`), a listed file unreadable or of the wrong kind, or a
    ``.metadata`` that is not DCP metadata (truncated, garbage). The ranks verify checksums."""
    try:
        info = check_complete(path)
    except CheckpointError as e:
        return str(e)
    for name in sorted(info["files"]):
        problem = unreadable_file(path / name)
        if problem is not None:
            return f"checkpoint {path} is unreadable: {path / name} {problem}"
    try:
        with open(path / DCP_METADATA_FILE, "rb") as f:
            load_metadata(f)
    except Exception as e:  # noqa: BLE001 - whatever unpickling a cut or garbage file raises
        return (
            f"checkpoint {path} is corrupt: {path / DCP_METADATA_FILE} is not DCP metadata "
            f"({type(e).__name__}: {str(e)[:200]})"
        )
    return None
