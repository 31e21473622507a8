"""`MeshContext`: the one source of layout truth (sizes, meshes by axis name, `*_enabled`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from automodel.mesh.axes import dense_axes, flattened_axes, moe_axes
from automodel.mesh.planned import own_groups_mesh
from automodel.mesh.sizes import ParallelismSizes, ResolvedLayout
from automodel.mesh.torch_internals import flatten_mesh


@dataclass
class MeshContext:
    """Device meshes of one rank plus the resolved layout they were built from.

    The dense mesh has dims ``(pp, dp_replicate, dp_shard, cp, tp)`` (and a plugin's registered
    axis, `automodel.mesh.register_axis`) and flattened views ``dp``,
    ``dp_shard_cp`` and ``dp_cp``. When ``ep > 1`` a MoE mesh ``(pp, ep_shard, ep)`` spans the
    ``dp*cp`` ranks of this rank's pp stage and tp coordinate.
    """

    layout: ResolvedLayout
    device_mesh: DeviceMesh
    moe_mesh: DeviceMesh | None = None
    _flattened: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    #: Meshes over dense axes no flattened axis spans (`mesh_over`), by their axes.
    _spanned: dict[tuple[str, ...], DeviceMesh] = field(default_factory=dict, repr=False)

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        sizes: ParallelismSizes,
        *,
        world_size: int | None = None,
        device_type: str | None = None,
    ) -> MeshContext:
        """Resolve `sizes` for the current process group and create every mesh and group.

        Needs an initialized default process group (real, or torch's ``fake`` backend for
        planning a large job in one process).
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "MeshContext.build needs an initialized process group: call "
                "automodel.mesh.init_distributed() (or automodel.mesh.fake_world() for planning) first"
            )
        actual = dist.get_world_size()
        if world_size is not None and world_size != actual:
            raise ValueError(f"world_size={world_size} but the process group has {actual} ranks")
        layout = sizes.resolve(actual)
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
        # A fake world (planning) is one process standing for one rank: it creates only that
        # rank's group of each axis (see `planned`), not every rank's.
        fake = dist.get_backend() == "fake"
        if fake:
            mesh = own_groups_mesh(device_type, layout.dense_shape, dense_axes())
        else:
            mesh = init_device_mesh(device_type, layout.dense_shape, mesh_dim_names=dense_axes())
        flattened = {name: flatten_mesh(mesh[axes], name) for name, axes in flattened_axes().items()}
        moe_mesh = None
        if layout.ep_enabled:
            moe_names = (*moe_axes(), "moe_tp")
            if fake:
                moe_root = own_groups_mesh(device_type, layout.moe_shape, moe_names)
            else:
                ranks = torch.arange(layout.world_size).reshape(layout.moe_shape)
                moe_root = DeviceMesh(device_type, ranks, mesh_dim_names=moe_names)
            moe_mesh = moe_root[moe_axes()]
        ctx = cls(layout=layout, device_mesh=mesh, moe_mesh=moe_mesh, _flattened=flattened)
        if fake:
            ctx.check_groups()
        return ctx

    def check_groups(self) -> None:
        """Every axis group of this rank holds exactly the ranks `ResolvedLayout.group_ranks` gives.

        The meshes come from torch's rank grid, the layout from its own arithmetic: planning checks
        one against the other (a fake world has no collective to check them with)."""
        rank = dist.get_rank()
        for axis in self.layout.axis_names():
            if axis in moe_axes()[1:] and not self.ep_enabled:
                continue
            members = dist.get_process_group_ranks(self.get_mesh(axis).get_group())
            expected = self.layout.group_ranks(rank, axis)
            if members != expected:
                raise RuntimeError(
                    f"rank {rank}: the {axis} group holds ranks {members[:16]}, the layout expects "
                    f"{expected[:16]} ({self.layout.describe()})"
                )

    # ---- lookup --------------------------------------------------------------------------
    def get_mesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of a dense, flattened (dp, dp_shard_cp, dp_cp) or MoE (ep, ep_shard) axis."""
        if name in dense_axes():
            return self.device_mesh[name]
        if name in self._flattened:
            return self._flattened[name]
        if name in moe_axes()[1:]:
            if self.moe_mesh is None:
                raise ValueError(
                    f"mesh axis {name!r} exists only when ep_size > 1 (ep_size={self.layout.ep})"
                )
            return self.moe_mesh[name]
        raise ValueError(f"unknown mesh axis {name!r}; known: {', '.join(ResolvedLayout.axis_names())}")

    def mesh_over(self, axes: tuple[str, ...]) -> DeviceMesh | None:
        """The 1-D mesh of this rank spanning the dense `axes` (a role's: the ranks a loss or a
        gradient norm sums over), None when they hold one rank. Axes of size 1 change no group, so
        the dense axis, or the flattened axis spanning the same ranks, answers; a set no axis spans
        is flattened on the first call, once (a collective: every rank asks at the same point)."""
        unknown = [a for a in axes if a not in dense_axes()]
        if unknown:
            raise ValueError(f"mesh_over takes dense axes; {unknown} are not ({', '.join(dense_axes())})")
        wide = tuple(a for a in dense_axes() if a in axes and self.layout.axis_size(a) > 1)
        if not wide:
            return None
        if len(wide) == 1:
            return self.device_mesh[wide[0]]
        for name, spans in flattened_axes().items():
            if tuple(a for a in spans if self.layout.axis_size(a) > 1) == wide:
                return self._flattened[name]
        if wide not in self._spanned:
            self._spanned[wide] = flatten_mesh(self.device_mesh[wide], "_".join(wide))
        return self._spanned[wide]

    def get_optional_mesh(self, name: str) -> DeviceMesh | None:
        """Like `get_mesh`, but None when the axis has size 1 (the parallelism is off).

        The MoE axes (ep, ep_shard) are None whenever expert parallelism is off.
        """
        if self.layout.axis_size(name) == 1 or (name in moe_axes()[1:] and not self.ep_enabled):
            return None
        return self.get_mesh(name)

    # ---- convenience views of the layout -------------------------------------------------
    @property
    def device_type(self) -> str:
        return self.device_mesh.device_type

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def coordinates(self) -> dict[str, int]:
        return self.layout.coordinates(self.rank)

    def size(self, name: str) -> int:
        return self.layout.axis_size(name)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def pp_enabled(self) -> bool:
        return self.layout.pp_enabled

    @property
    def dp_enabled(self) -> bool:
        return self.layout.dp_enabled

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.layout.dp_replicate_enabled

    @property
    def dp_shard_enabled(self) -> bool:
        return self.layout.dp_shard_enabled

    @property
    def fsdp_enabled(self) -> bool:
        return self.layout.fsdp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.layout.cp_enabled

    @property
    def tp_enabled(self) -> bool:
        return self.layout.tp_enabled

    @property
    def ep_enabled(self) -> bool:
        return self.layout.ep_enabled
