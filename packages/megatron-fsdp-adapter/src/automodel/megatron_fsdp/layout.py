"""Which layouts Megatron-FSDP accepts, and which mesh axes it shards and reduces over."""

from __future__ import annotations

from dataclasses import dataclass

from automodel.mesh import MeshContext


@dataclass(frozen=True)
class MegatronFSDPAxes:
    """Mesh axis names handed to megatron-fsdp (`dp_shard_dim`, `tp_dim`) and the shard group size."""

    dp_shard_dim: str
    tp_dim: str
    dp_group_size: int

    @property
    def shards(self) -> bool:
        """False when there is no data parallelism: only TP is applied."""
        return self.dp_group_size > 1


def check_layout(mesh: MeshContext) -> None:
    """Seed rules: no pipeline, expert or replicate parallelism with Megatron-FSDP."""
    layout = mesh.layout
    for key, size in (
        ("pp_size", layout.pp),
        ("ep_size", layout.ep),
        ("dp_replicate_size", layout.dp_replicate),
    ):
        if size != 1:
            raise ValueError(
                f"{key}={size} is not supported with strategy megatron_fsdp (only dp, tp and cp); "
                f"set {key}=1 or use strategy fsdp2 ({layout.describe()})"
            )


def megatron_fsdp_axes(mesh: MeshContext) -> MegatronFSDPAxes:
    """Shard over ``dp`` — or ``dp_cp`` when cp > 1, since CP ranks hold the same weights and
    their gradients must be reduced too. TP stays on ``tp`` (megatron-fsdp shards TP DTensors
    strided over ``(dp_shard_dim, tp)``)."""
    check_layout(mesh)
    name = "dp_cp" if mesh.layout.cp_enabled else "dp"
    return MegatronFSDPAxes(dp_shard_dim=name, tp_dim="tp", dp_group_size=mesh.layout.axis_size(name))
