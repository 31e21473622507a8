"""Convert a format-1 checkpoint (training state pickled) into the pickle-free format 2.

Format 1 stored each rank's step, LR schedulers, dataloader position and RNG state as one
``pickle.dumps`` blob; unpickling runs whatever the blob says, so `Checkpointer.restore` refuses
it. Only the blobs are unpickled here, and only with ``trust_pickle=True``: run this on a
checkpoint you trust (one you wrote yourself). Model and optimizer tensors are read with
``weights_only=True`` and the DCP metadata through the restricted unpickler of `safe_dcp`.

    python -m automodel.recipes.checkpoint.convert_legacy --trust-pickle OLD_STEP_DIR NEW_DIR

The whole state is loaded into one process (no distributed setup, full tensors in CPU memory)
and saved again unsharded; resuming from it reshards to any layout as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

from automodel.recipes.checkpoint import paths
from automodel.recipes.checkpoint.checkpointer import FORMAT_VERSION
from automodel.recipes.checkpoint.integrity import CHECKSUMS_KEY, sha256_file
from automodel.recipes.checkpoint.safe_dcp import SafeEmptyStateDictLoadPlanner, SafeFileSystemReader
from automodel.recipes.checkpoint.state import EXTRA_PREFIX, encode_extra
from automodel.recipes.torch_internals import load_state_dict_in_one_process


def _to_tensor_friendly(value: Any) -> Any:
    """numpy arrays (in the old numpy RNG state) become tensors; the rest is left as it is."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.astype(np.int64))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: _to_tensor_friendly(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_tensor_friendly(v) for v in value)
    return value


def _convert_rng(rng: dict[str, Any]) -> dict[str, Any]:
    version, mt, gauss_next = rng["python"]
    out: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(mt, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "torch": rng["torch"],
    }
    if "cuda" in rng:
        out["cuda"] = rng["cuda"]
    if "numpy" in rng:
        kind, keys, pos, has_gauss, cached = _to_tensor_friendly(rng["numpy"])
        out["numpy"] = {
            "kind": str(kind),
            "keys": keys,
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    return out


def convert_legacy_checkpoint(
    *, source: str | os.PathLike, destination: str | os.PathLike, trust_pickle: bool
) -> Path:
    """Write a format-2 copy of the format-1 checkpoint `source` to `destination` (must not exist).

    `trust_pickle` must be True: the old training-state blobs are unpickled, which runs any code
    they hold. Returns `destination`.
    """
    if trust_pickle is not True:
        raise ValueError(
            f"trust_pickle must be True to convert a pickled checkpoint (it runs code from it), got {trust_pickle!r}"
        )
    source, destination = Path(source), Path(destination)
    info = paths.check_complete(source)
    if destination.exists():
        raise ValueError(f"destination {str(destination)!r} already exists")
    state: dict[str, Any] = {}
    load_state_dict_in_one_process(
        state, reader=SafeFileSystemReader(str(source)), planner=SafeEmptyStateDictLoadPlanner()
    )
    legacy = sorted(k for k, v in state.items() if k.startswith(EXTRA_PREFIX) and isinstance(v, bytes))
    if not legacy:
        raise ValueError(f"checkpoint {str(source)!r} holds no pickled training state: nothing to convert")
    for key in legacy:
        extra = pickle.loads(state[key])  # noqa: S301 - the caller vouched for this checkpoint
        extra = dict(
            _to_tensor_friendly({k: v for k, v in extra.items() if k != "rng"}),
            rng=_convert_rng(extra["rng"]),
        )
        state[key] = encode_extra(extra)
    tmp = destination.parent / f"{paths.TMP_PREFIX}{destination.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    if (source / paths.CONSOLIDATED_DIR).is_dir():
        shutil.copytree(source / paths.CONSOLIDATED_DIR, tmp / paths.CONSOLIDATED_DIR)

    files = paths.file_sizes(tmp)
    checksums = {name: sha256_file(tmp / name) for name in files}
    info = dict(info, format_version=FORMAT_VERSION, converted_from=str(source), files=files)
    info[CHECKSUMS_KEY] = checksums  # the converted files' own (the source's no longer apply)
    (tmp / paths.INFO_FILE).write_text(json.dumps(info, indent=2))
    os.replace(tmp, destination)
    return destination


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="the format-1 step directory (e.g. runs/x/checkpoints/step_10)")
    parser.add_argument("destination", help="a new directory to write the converted checkpoint to")
    parser.add_argument(
        "--trust-pickle",
        action="store_true",
        help="required: unpickles the old training state, which runs any code it holds",
    )
    args = parser.parse_args(argv)
    if not args.trust_pickle:
        print(
            "refusing to convert: the old format is a pickle that can run code; "
            "pass --trust-pickle if you trust whoever wrote this checkpoint",
            file=sys.stderr,
        )
        return 2
    out = convert_legacy_checkpoint(source=args.source, destination=args.destination, trust_pickle=True)
    print(f"converted {args.source} -> {out}; resume with checkpoint.restore_from={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
