"""Published MoE checkpoints keep one tensor per expert; transformers 5 models stack them.

A Hub checkpoint of Mixtral, Qwen-MoE, DeepSeek and the like (and transformers' own
``save_pretrained`` of such a model) stores ``...experts.<e>.gate_proj.weight`` [I, H],
``up_proj`` [I, H] and ``down_proj`` [H, I] per expert e, while the in-memory model holds
``experts.gate_up_proj`` [E, 2I, H] (gate rows first, then up, per expert) and
``experts.down_proj`` [E, H, I]. This module finds stacked keys whose per-expert sources are in
the files and fills this rank's shard of them (only the experts it holds are read).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

#: stacked key suffix -> per-expert weight names concatenated (along dim 0) into one expert's slice
_STACKED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def per_expert_sources(keys: list[str], available: set[str]) -> dict[str, list[list[str]]]:
    """Stacked keys missing from `available` whose per-expert tensors are all there: key ->
    for each expert, the names whose concatenation is that expert's slice."""
    out: dict[str, list[list[str]]] = {}
    for key in keys:
        prefix, _, leaf = key.rpartition(".")
        if key in available or leaf not in _STACKED or not prefix.endswith("experts"):
            continue
        sources = []
        e = 0
        while all(f"{prefix}.{e}.{part}.weight" in available for part in _STACKED[leaf]):
            sources.append([f"{prefix}.{e}.{part}.weight" for part in _STACKED[leaf]])
            e += 1
        if sources:
            out[key] = sources
    return out


def _file_of(directory: Path) -> dict[str, Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return {k: directory / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    mapping = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            mapping.update({k: path for k in f.keys()})
    return mapping


def _local_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage of `t` and the slice of the full tensor it holds."""
    if not isinstance(t, DTensor):
        return t, tuple(slice(0, s) for s in t.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape))


@torch.no_grad()
def load_stacked_experts(
    targets: dict[str, torch.Tensor], sources: dict[str, list[list[str]]], directory: Path
) -> None:
    """Fill each target (a state-dict tensor, sharded or not) from its per-expert tensors."""
    from safetensors import safe_open

    files = _file_of(directory)
    handles: dict[Path, object] = {}
    try:
        for key, per_expert in sources.items():
            local, region = _local_region(targets[key])
            experts = range(region[0].start, region[0].stop)
            slabs = []
            for e in experts:
                parts = []
                for name in per_expert[e]:
                    path = files[name]
                    if path not in handles:
                        handles[path] = safe_open(str(path), framework="pt")
                    parts.append(handles[path].get_tensor(name))
                slabs.append(torch.cat(parts, dim=0))
            full_rows = torch.stack(slabs)  # this rank's experts, full in the other dims
            local.copy_(full_rows[(slice(None), *region[1:])].to(local.dtype))
    finally:
        handles.clear()
