"""DTensors across pipeline stage boundaries: sent as their local shards, rebuilt by the next stage.

Under sequence parallelism the residual stream between decoder layers is a DTensor (``Shard(1)``
over the tp mesh), so a stage's output is one. torch's `PipelineStage` moves plain tensors; torch
>= 2.13 can move DTensors only given a ``get_mesh`` callback that torch 2.11 does not have. So a
stage sends the local shard of each DTensor it outputs (`to_local`, whose backward turns the
received gradient into a gradient of that same layout) and the next stage rebuilds the DTensor
from the received shard before its module runs (`from_local`, whose backward redistributes a
gradient of another layout, e.g. a partial sum, to the local shard of the declared one). torch's
p2p buffers, shape inference and V-schedule hand-offs then only ever see the local shards.

The receiving rank never sees the sender's DTensor, only the bytes of its local shard, and a
parallelized module does not record the layout of the activations it expects: the caller that
applied the tensor-parallel plan declares it (`BoundaryLayout`, per position of what a stage
sends). The sending side checks every DTensor it sends against that declaration, so a missing or
wrong one fails at the first forward naming the output, instead of rebuilding a wrong layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard, distribute_tensor


@dataclass(frozen=True)
class BoundaryLayout:
    """The DTensor layout of a tensor a stage sends to the next: the mesh and placements the
    receiving stage rebuilds it with (sequence parallelism: the tp mesh and ``(Shard(1),)``)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        placements = tuple(self.placements)
        object.__setattr__(self, "placements", placements)
        if not all(isinstance(p, Placement) for p in placements):
            raise ValueError(f"placements must be torch Placements, got {placements!r}")
        if len(placements) != self.mesh.ndim:
            raise ValueError(
                f"placements {placements} give {len(placements)} placements for a {self.mesh.ndim}-dimensional mesh"
            )

    def __str__(self) -> str:
        return f"mesh {self.mesh.mesh_dim_names or tuple(self.mesh.shape)} placements {self.placements}"

    def matches(self, t: DTensor) -> bool:
        return t.device_mesh == self.mesh and tuple(t.placements) == self.placements

    def even_global_shape(self, local_shape: Sequence[int]) -> torch.Size:
        """The global shape whose even shards have `local_shape` (what `from_local` assumes)."""
        shape = list(local_shape)
        for mesh_dim, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                shape[placement.dim] *= self.mesh.size(mesh_dim)
        return torch.Size(shape)

    def local_shard(self, t: DTensor, *, stage_index: int, position: int) -> torch.Tensor:
        """Sending side: the local shard of `t` as a stage output (contiguous, not a view)."""
        if not self.matches(t):
            raise ValueError(
                f"pipeline stage {stage_index} sends output {position} as a DTensor on mesh "
                f"{t.device_mesh.mesh_dim_names} with placements {tuple(t.placements)}, but the boundary "
                f"layout declares {self}; the next stage would rebuild it wrongly"
            )
        local = t.to_local()
        if t.shape != self.even_global_shape(local.shape):
            raise ValueError(
                f"pipeline stage {stage_index} sends output {position} of shape {tuple(t.shape)} unevenly sharded "
                f"({self}): the next stage rebuilds it from its local shard assuming even shards; make the "
                "sharded dimension a multiple of the mesh size (e.g. pp_seq_len a multiple of tp_size)"
            )
        return sendable(local)

    def local_meta(self, t: torch.Tensor) -> torch.Tensor:
        """Sending side, shape inference on meta tensors: this rank's local shard of a global shape."""
        return distribute_tensor(t, self.mesh, self.placements, src_data_rank=None).to_local()

    def rebuild(self, local: torch.Tensor) -> DTensor:
        """Receiving side: the DTensor of which `local` is this rank's shard (differentiable)."""
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False)


#: What `AutoPipeline.build` accepts: one layout (the hidden states, position 0) or one per position.
BoundaryLayouts = BoundaryLayout | Sequence[BoundaryLayout | None] | None


def sendable(t: torch.Tensor) -> torch.Tensor:
    """`t` as a stage output: contiguous (p2p sends need it) and not a view (torch detaches stage
    outputs in place after their backward; `to_local` returns a view of the shard, and a value a
    stage passes on unchanged is a view of its input)."""
    t = t.contiguous()
    return t.clone() if t._is_view() else t


def normalize_layouts(layouts: BoundaryLayouts) -> tuple[BoundaryLayout | None, ...]:
    """One layout (the hidden states, position 0) or one per position of what a stage sends."""
    if layouts is None:
        return ()
    if isinstance(layouts, BoundaryLayout):
        return (layouts,)
    if isinstance(layouts, Sequence) and all(x is None or isinstance(x, BoundaryLayout) for x in layouts):
        return tuple(layouts)
    raise ValueError(
        f"boundary_layouts must be a BoundaryLayout or a sequence of BoundaryLayout | None, got {layouts!r}"
    )


def _outputs_to_local(output: Any, layouts: tuple[BoundaryLayout | None, ...], stage_index: int) -> Any:
    """A stage's output with every DTensor replaced by its local shard (checked against `layouts`)."""
    single = isinstance(output, torch.Tensor)
    outputs = (output,) if single else output
    if not isinstance(outputs, tuple | list):
        return output
    converted = []
    for position, out in enumerate(outputs):
        layout = layouts[position] if position < len(layouts) else None
        converted.append(_output_to_local(out, layout, stage_index=stage_index, position=position))
    return converted[0] if single else type(outputs)(converted)


def _output_to_local(out: Any, layout: BoundaryLayout | None, *, stage_index: int, position: int) -> Any:
    if isinstance(out, DTensor):
        if layout is None:
            raise ValueError(
                f"pipeline stage {stage_index} sends output {position} as a DTensor (mesh "
                f"{out.device_mesh.mesh_dim_names}, placements {tuple(out.placements)}), but no boundary layout "
                "declares it: pass boundary_layouts to AutoPipeline.build (e.g. BoundaryLayout(mesh=tp_mesh, "
                "placements=(Shard(1),)) under sequence parallelism) so the next stage can rebuild it"
            )
        return layout.local_shard(out, stage_index=stage_index, position=position)
    if layout is None or not isinstance(out, torch.Tensor):
        return out
    if out.is_meta:  # shape inference on meta tensors computes global shapes
        return layout.local_meta(out)
    raise ValueError(
        f"pipeline stage {stage_index} sends output {position} as a plain tensor, but the boundary layout "
        f"declares a DTensor ({layout}); the next stage would rebuild a wrong tensor from it"
    )


def attach_boundary_layouts(
    module: nn.Module,
    *,
    layouts: tuple[BoundaryLayout | None, ...],
    stage_index: int,
    num_stages: int,
) -> None:
    """Hooks on a stage module: rebuild the declared DTensors among its received inputs before any
    other pre-forward hook (they and the forward see what one process sees), and turn the DTensors
    among its outputs into local shards before any other forward hook (they see what is sent).

    The last stage's output is the loss function's, not sent, and is left alone; the first
    stage's inputs are the model's inputs, not received."""
    if stage_index > 0 and layouts:

        def rebuild_inputs(_: nn.Module, args: tuple) -> tuple:
            return tuple(
                layouts[i].rebuild(a)
                if i < len(layouts) and layouts[i] is not None and isinstance(a, torch.Tensor)
                else a
                for i, a in enumerate(args)
            )

        module.register_forward_pre_hook(rebuild_inputs, prepend=True)
    if stage_index < num_stages - 1:

        def outputs_to_local(_: nn.Module, args: tuple, output: Any) -> Any:
            return _outputs_to_local(output, layouts, stage_index)

        module.register_forward_hook(outputs_to_local, prepend=True)
