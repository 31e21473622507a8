"""Hugging Face Hub ids resolved through the local cache only: never a download.

A model, tokenizer or dataset named in a YAML is either a local path or a Hub id
(``org/name``, optionally ``org/name@revision``) that must already be in the local Hugging Face
cache (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``; the variables
are read at call time). Lookups use ``huggingface_hub.snapshot_download(local_files_only=True)``,
which reads the cache's ``refs/`` and ``snapshots/`` folders and never opens a connection; an id
that is not cached is a `ConfigError` naming the YAML key, not a download that may hang.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from automodel.data.errors import ConfigError, optional

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?(@[A-Za-z0-9._/-]+)?$")


def hub_cache_dir() -> str:
    """The Hub cache folder, from the environment as it is now (not as it was at import)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.environ[var]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")

    return optional("huggingface_hub.constants", needed_for="a Hub id").HF_HUB_CACHE


def is_hub_id(name: str) -> bool:
    """``org/name`` or ``name`` (optionally ``@revision``): the shape of a Hub repository id."""
    return bool(_REPO_ID.match(name)) and not name.startswith(".")


def resolve_local_or_cached(
    name_or_path: str, *, key: str, repo_type: str = "model", required_file: str | None = None
) -> Path:
    """A local directory for `name_or_path`: the path itself, or the cached snapshot of a Hub id.

    `required_file` (e.g. ``config.json``) must be in the directory. `ConfigError` naming `key`
    when the path does not exist and the id is not in the local cache.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(
                key, name_or_path, "is a file; give a directory (or a Hub id in the local cache)"
            )
        directory = path
    else:
        if not is_hub_id(name_or_path):
            raise ConfigError(key, name_or_path, "does not exist (a local directory or a Hub id `org/name`)")
        repo_id, _, revision = name_or_path.partition("@")
        cache = hub_cache_dir()

        try:
            directory = Path(
                optional("huggingface_hub", needed_for="a Hub id").snapshot_download(
                    repo_id=repo_id,
                    repo_type=repo_type,
                    revision=revision or None,
                    cache_dir=cache,
                    local_files_only=True,
                )
            )
        except Exception as e:  # noqa: BLE001 - any miss is the same user-facing fact
            kind = "" if repo_type == "model" else f"{repo_type} "
            raise ConfigError(
                key,
                name_or_path,
                f"is not a local directory and the Hub {kind}id is not in the local Hugging Face cache "
                f"({cache}; {type(e).__name__}). Nothing is downloaded: fetch it where there is network "
                f"(`hf download {repo_id}{' --repo-type ' + repo_type if repo_type != 'model' else ''}`) "
                "and point HF_HUB_CACHE at that cache, or give a local directory",
            ) from None
    if required_file is not None and not (directory / required_file).is_file():
        raise ConfigError(
            key, name_or_path, f"is not a Hugging Face model directory (no {required_file} in {directory})"
        )
    return directory
