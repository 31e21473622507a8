"""Device meshes of the one rank a `fake_world` stands for, built from that rank's own groups.

With a real backend every rank takes part in creating every group, so `init_device_mesh` calls
`new_group` once per group of every axis. A fake world is one process: the other ranks' groups
would only be non-member placeholders, yet at 16,384 ranks they were 39,040 `new_group` calls
(~1.5 s), 84% of them the 16,384 singleton groups of each size-1 axis. Here each axis gets the
one group this rank is in (a real fake-backend process group), taken from the same row-major rank
grid `init_device_mesh` uses, and the mesh is assembled with `DeviceMesh.from_group`; flattened
axes are then made by torch's own flatten (`torch_internals.flatten_mesh`), as for a real mesh.
"""

from __future__ import annotations

from math import prod

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def rank_grid(shape: tuple[int, ...]) -> torch.Tensor:
    """Global ranks laid out row-major over `shape` (what `init_device_mesh` builds)."""
    return torch.arange(prod(shape), dtype=torch.int).reshape(shape)


def own_group_ranks(grid: torch.Tensor, rank: int) -> list[list[int]]:
    """For each dim of `grid`, the ranks that share every other coordinate with `rank`, in dim order."""
    coords: list[int] = []
    for size in reversed(grid.shape):  # row-major: the last dim varies fastest
        rank, c = divmod(rank, size)
        coords.insert(0, c)
    groups = []
    for dim in range(grid.ndim):
        index = tuple(slice(None) if d == dim else c for d, c in enumerate(coords))
        groups.append(grid[index].tolist())
    return groups


def own_groups_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A `DeviceMesh` over the row-major grid of `shape` whose dim groups are only this rank's.

    Only valid in a fake world (one process stands for every rank): with a real backend the
    other members would have to create the same groups in the same order."""
    assert dist.get_backend() == "fake", "own_groups_mesh builds one rank's groups: fake backend only"
    grid = rank_grid(shape)
    groups = [
        dist.new_group(ranks=ranks, group_desc=f"mesh_{name}")
        for ranks, name in zip(own_group_ranks(grid, dist.get_rank()), names, strict=True)
    ]
    return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=names)
