"""What this rank actually holds after a layout was applied, as plain JSON-able data.

Read off the live modules, not off a config: DTensor mesh axes, placements, global and local
shapes and offsets of every parameter; FSDP2 units; the DDP wrapper and its reducer;
activation-checkpointed modules; the decoder layers a part holds. One producer for every reader:
`recipes train` writes it per rank (``logging.layout_report``, adding pipeline stages and
megatron-fsdp buffers), and the package tests hand it to `automodel.testing.layout_check`, which fails
unless the layout was really applied. Only torch is imported.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from automodel.mesh.context import MeshContext
from automodel.mesh.model_parts import canonical_fqn, find_layer_list
from automodel.mesh.torch_internals import CHECKPOINT_WRAPPED, global_offset

#: Where a decoder layer index appears in a parameter FQN when the part has no layer list of its own.
_LAYER_MARK = ".layers."


def describe_tensor(t: torch.Tensor) -> dict[str, Any]:
    """Mesh axes, placements, shapes (and, for DTensors, this rank's offset) of one tensor."""
    if isinstance(t, DTensor):
        local = t.to_local()
        return {
            "mesh": list(t.device_mesh.mesh_dim_names or ()),
            "placements": [str(p) for p in t.placements],
            "shape": list(t.shape),
            "local_shape": list(local.shape),
            # megatron-fsdp shards flattened buffers unevenly: the even-chunk offset would be wrong.
            "offset": None if getattr(t, "__fsdp_param__", False) else global_offset(t),
            "dtype": str(t.dtype).removeprefix("torch."),
        }
    return {
        "mesh": None,
        "placements": None,
        "shape": list(t.shape),
        "local_shape": list(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
    }


def layer_indices(names: list[str], *, layers_fqn: str | None = None) -> list[int]:
    """Decoder layer indices present in a list of parameter FQNs (``<layers_fqn>.<i>....``; by
    default any ``...layers.<i>....``)."""
    found = set()
    mark = f"{layers_fqn}." if layers_fqn else _LAYER_MARK
    for name in names:
        if layers_fqn and not name.startswith(mark):
            continue
        _, hit, rest = name.partition(mark)
        head = rest.split(".", 1)[0]
        if hit and head.isdigit():
            found.add(int(head))
    return sorted(found)


def default_layers_fqn(part: nn.Module) -> str | None:
    """FQN (as the model names it) of the part's decoder layer list (`find_layer_list`)."""
    found = find_layer_list(part)
    return canonical_fqn(found[0]) if found else None


def describe_module(
    part: nn.Module, *, layers_fqn: str | None, stage_ids: list[int] | None = None
) -> dict[str, Any]:
    """One model part (the model, or one pipeline stage module) as this rank holds it; its decoder
    layers are the ones under `layers_fqn` (`default_layers_fqn` for a whole model)."""
    params = {canonical_fqn(name): describe_tensor(p) for name, p in part.named_parameters()}
    report: dict[str, Any] = {
        "wrapper": type(part).__name__,
        "parameters": params,
        "layers_fqn": layers_fqn,
        "layers": layer_indices(list(params), layers_fqn=layers_fqn),
        "fsdp_units": sorted(
            canonical_fqn(n) or "<root>" for n, m in part.named_modules() if isinstance(m, FSDPModule)
        ),
    }
    report["checkpointed"] = sorted(
        canonical_fqn(n)
        for n, m in part.named_modules()
        # torch's checkpoint wrapper, or automodel.moe's in-place recomputation of a block
        if hasattr(m, CHECKPOINT_WRAPPED) or getattr(m, "_recomputed_in_backward", False)
    )
    if stage_ids is not None:
        report["stage_ids"] = stage_ids
    if isinstance(part, DistributedDataParallel):
        report["ddp"] = {
            "reducer": getattr(part, "reducer", None) is not None,
            "group_size": part.process_group.size(),
        }
    return report


def rank_report(
    *, parts: list[dict[str, Any]], mesh: MeshContext, strategy: str, cp_backend: str = "none"
) -> dict[str, Any]:
    """The whole report of this rank: its layout (every mesh axis's size, a registered one's
    included, and its coordinates) plus every part it holds (each described by `describe_module`)."""
    layout = mesh.layout
    return {
        "rank": mesh.rank,
        "strategy": strategy,
        "axis_sizes": {axis: layout.axis_size(axis) for axis in layout.axis_names()},
        "coordinates": dict(mesh.coordinates),
        "cp_backend": cp_backend,
        "parts": parts,
    }
