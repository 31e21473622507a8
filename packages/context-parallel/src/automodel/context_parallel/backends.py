"""The attention backends under CP, how "auto" picks one, and the lazy Transformer Engine import."""

from __future__ import annotations

import importlib
from types import ModuleType

from torch.distributed.device_mesh import DeviceMesh

from automodel.context_parallel.ring_attention import KV_ROTATIONS

#: "ring": this package's ring attention (any device); "torch": torch's context_parallel() with
#: SDPA (CUDA); "te": Transformer Engine DotProductAttention with its CP group (CUDA).
BACKENDS: tuple[str, ...] = ("auto", "ring", "torch", "te")


def resolve_backend(backend: str, *, device_type: str) -> str:
    """The concrete backend for `backend` on `device_type` ("auto": torch on CUDA, else ring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "torch" if device_type == "cuda" else "ring"
    if backend in ("torch", "te") and device_type != "cuda":
        raise ValueError(
            f"backend={backend!r} needs CUDA (the CP mesh is on {device_type!r}): torch's context_parallel has no "
            "CPU SDPA sharding rule and Transformer Engine is CUDA-only; use backend='ring'"
        )
    return backend


def cp_submesh(mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D CP mesh: `mesh` itself, or its ``"cp"`` dim when given the whole device mesh."""
    if mesh is None or mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names or ()
    if "cp" not in names:
        raise ValueError(f"cp_mesh must be a 1-D DeviceMesh or have a 'cp' dim, got dims {names}")
    return mesh["cp"]


def check_kv_rotation(kv_rotation: str) -> None:
    if kv_rotation not in KV_ROTATIONS:
        raise ValueError(f"kv_rotation must be one of {KV_ROTATIONS}, got {kv_rotation!r}")


def import_transformer_engine() -> ModuleType:
    """``transformer_engine.pytorch``, or an ImportError that says how to get it."""
    try:  # by name: an optional CUDA-only extra, absent where CI type-checks
        te = importlib.import_module("transformer_engine.pytorch")
    except ImportError as err:
        raise ImportError(
            "backend='te' (and THD attention through Transformer Engine) needs transformer-engine: install "
            "`automodel-context-parallel[te]` on a CUDA machine"
        ) from err
    return te
