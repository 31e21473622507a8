"""Sample-order arrays cached in ``index_mapping_dir`` (megatron-core's ``path_to_cache``), memory-mapped.

Building megatron-core's order costs time and memory linear in the documents and samples; with a
cache folder it is built once (by whichever rank gets there first; every rank builds the same
arrays, written to a private temporary name and renamed, so concurrent writers cannot tear a
file) and later start-ups map the ``.npy`` files, touching only the pages their samples need.
The file name is a hash of everything the arrays depend on.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

#: bump when the arrays' meaning changes, so stale caches are not read
CACHE_VERSION = 1


def _key(description: dict[str, Any]) -> str:
    text = json.dumps({"version": CACHE_VERSION, **description}, sort_keys=True)
    return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()


def cached_arrays(
    folder: str | None, *, kind: str, description: dict[str, Any], build: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """`build()`'s arrays, read from (or written to) `folder` when one is given."""
    if folder is None:
        return build()
    base = Path(folder).expanduser() / f"{_key(description)}-{kind}"
    names_file = base.with_name(base.name + "-description.json")
    if names_file.is_file():
        names = json.loads(names_file.read_text())["arrays"]
        paths = {n: base.with_name(f"{base.name}-{n}.npy") for n in names}
        if all(p.is_file() for p in paths.values()):
            return {n: np.load(p, mmap_mode="r") for n, p in paths.items()}
    arrays = build()
    base.parent.mkdir(parents=True, exist_ok=True)
    for name, array in arrays.items():
        final = base.with_name(f"{base.name}-{name}.npy")
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            np.save(f, array)
        os.replace(tmp, final)
    tmp = names_file.with_name(f".{names_file.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"arrays": sorted(arrays), **description}, indent=1, sort_keys=True))
    os.replace(tmp, names_file)  # written last: its presence means every array is complete
    return arrays
