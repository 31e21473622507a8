"""Load a local Hugging Face safetensors directory straight into (sharded) parameters.

DCP's HF reader plans reads against this rank's DTensor shards and reads only those slices
from the safetensors files, so no rank materialises the full model when the layout shards it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict


def _tied_keys(part: nn.Module, keys: set[str]) -> set[str]:
    """Keys that share storage with another key of `part` (tied embeddings): HF saves only one."""
    seen: dict[int, str] = {}
    tied = set()
    for name, param in part.named_parameters(remove_duplicate=False):
        ptr = id(param)
        if ptr in seen and name in keys:
            tied.add(name)
        seen.setdefault(ptr, name)
    return tied


def load_pretrained_weights(model_parts: list[nn.Module], directory: str | Path) -> None:
    """Fill every parameter and persistent buffer of `model_parts` from HF safetensors in `directory`.

    Collective: every rank calls it with its own parts. Tied weights absent from the files are
    left to the tie. Raises `ValueError` naming missing keys or a directory without safetensors.
    """
    directory = Path(directory)
    if not directory.is_dir() or not any(directory.glob("*.safetensors")):
        raise ValueError(f"model directory {str(directory)!r} holds no *.safetensors files")
    reader = dcp.HuggingFaceStorageReader(path=str(directory))
    available = set(reader.read_metadata().state_dict_metadata)
    part_sds = [get_model_state_dict(part) for part in model_parts]
    missing: list[str] = []
    for part, sd in zip(model_parts, part_sds):
        tied = _tied_keys(part, set(sd))
        missing += sorted(k for k in sd if k not in available and k not in tied)
    if dist.is_initialized():
        # Every rank raises together; a lone raise would leave the others waiting in dcp.load.
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, missing)
        missing = sorted({k for m in everyone for k in m})
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(
            f"model directory {str(directory)!r} lacks {len(missing)} weights this model needs: {shown}"
        )
    to_load = {k: v for sd in part_sds for k, v in sd.items() if k in available}
    dcp.load(to_load, storage_reader=reader)
    for part, sd in zip(model_parts, part_sds):
        set_model_state_dict(part, {k: to_load.get(k, v) for k, v in sd.items()})
