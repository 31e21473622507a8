"""Fill this rank's shard of parameters that transformers computes from several checkpoint tensors.

Each `ConvertedGroup` runs its transformers ``WeightConverter`` (the same operations
``from_pretrained`` runs) on tensors read from the safetensors files, then copies the slice this
rank holds. Stacked experts under expert parallelism read only this rank's experts: when the
converter first stacks one tensor per expert along dim 0 and no later operation touches dim 0, the
converted rows of a subset of experts are exactly those experts' rows of the full result.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from transformers.core_model_loading import MergeModulelist

from automodel.recipes.checkpoint.key_mapping import ConvertedGroup
from automodel.recipes.torch_internals import local_shape_and_global_offset


def _file_of(directory: Path) -> dict[str, Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {k: directory / f for k, f in json.loads(index.read_text())["weight_map"].items()}

    mapping = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            mapping.update({k: path for k in f.keys()})
    return mapping


def _row_window(t: torch.Tensor) -> slice | None:
    """The dim-0 rows of the full tensor this rank holds whole in every other dim (then the local
    storage is ``full[rows]``), or None where the layout splits it otherwise (TP columns, FSDP over
    TP's strided shards): those ranks convert the full tensor and shard it as the parameter is."""
    if not isinstance(t, DTensor):
        return slice(0, t.shape[0]) if t.dim() else None
    if any(type(p) is not Replicate and not (type(p) is Shard and p.dim == 0) for p in t.placements):
        return None

    shape, offset = local_shape_and_global_offset(t)
    return slice(offset[0], offset[0] + shape[0])


def _copy_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of `full` (the whole parameter) into `target`'s local storage."""
    if not isinstance(target, DTensor):
        target.copy_(full)
        return
    full = full.to(device=target.device, dtype=target.dtype)
    # Every rank holds `full`: each keeps its own shard, nothing is sent.
    shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
    target.to_local().copy_(shard.to_local())


def _keeps_expert_rows(operations: list[Any]) -> bool:
    """Whether the converter stacks per-expert tensors on dim 0 and leaves dim 0 alone afterwards."""
    if not operations or not isinstance(operations[0], MergeModulelist) or operations[0].dim != 0:
        return False
    for op in operations[1:]:
        dims = [getattr(op, name) for name in ("dim", "dim0", "dim1") if hasattr(op, name)]
        if not dims or any(d == 0 or d < -1 for d in dims):
            return False
    return True


class SafetensorsReader:
    """Reads tensors by checkpoint key from a safetensors directory, opening each file once."""

    def __init__(self, directory: Path) -> None:
        self.files = _file_of(directory)
        self.handles: dict[Path, Any] = {}

    def __call__(self, key: str) -> torch.Tensor:
        path = self.files[key]
        if path not in self.handles:
            self.handles[path] = safe_open(str(path), framework="pt")
        return self.handles[path].get_tensor(key)


@torch.no_grad()
def load_converted(
    groups: list[ConvertedGroup],
    targets: dict[str, torch.Tensor],
    *,
    read: Callable[[str], torch.Tensor],
    hf_model: Any,
) -> None:
    """Run each group's converter on tensors from `read` (checkpoint key -> tensor) and copy this
    rank's slice into `targets` (state-dict tensors, sharded or not). Raises `ValueError` naming
    the parameter when a result does not fit it."""
    for group in groups:
        local_targets = [t for t in group.targets if t in targets]
        if not local_targets:
            continue
        windows = {t: _row_window(targets[t]) for t in local_targets}
        rows = windows[local_targets[0]]
        subset = (
            rows is not None
            and _keeps_expert_rows(group.converter.operations)
            and all(w == rows for w in windows.values())
        )
        converter = group.converter
        for pattern, keys in group.sources.items():
            for key in keys[rows] if subset and rows is not None else keys:
                converter.add_tensor(group.first_target, key, pattern, lambda key=key: read(key))
        result = converter.convert(group.first_target, model=hf_model, config=hf_model.config)
        for name in local_targets:
            if name not in result:
                raise ValueError(
                    f"transformers' conversion for {group.first_target!r} produced {sorted(result)}, "
                    f"not {name!r}"
                )
            value = result[name]
            value = value[0] if isinstance(value, list) else value
            target = targets[name]
            expected = (rows.stop - rows.start, *target.shape[1:]) if subset else tuple(target.shape)
            if tuple(value.shape) != expected:
                sources = [k for keys in group.sources.values() for k in keys]
                raise ValueError(
                    f"checkpoint tensors {sources[:4]}{' ...' if len(sources) > 4 else ''} convert to "
                    f"shape {tuple(value.shape)} for {name!r}, which needs {expected}"
                )
            if subset:  # this rank's experts, whole in the other dims: the local storage itself
                local = target.to_local() if isinstance(target, DTensor) else target
                local.copy_(value.to(local.dtype))
            else:
                _copy_into(target, value)
