"""automodel.mesh: parallelism sizes, device meshes, process-group setup, model introspection."""

from automodel.mesh._version import __version__ as __version__
from automodel.mesh.axes import (
    Axis,
    axes,
    dense_axes,
    flattened_axes,
    moe_axes,
    parallel_axes,
    register_axis,
    unregister_axis,
)
from automodel.mesh.context import MeshContext
from automodel.mesh.distributed import (
    DistInfo,
    LaunchEnv,
    RendezvousError,
    default_backend,
    destroy_distributed,
    detect_launch_env,
    distributed_session,
    fake_world,
    init_distributed,
)
from automodel.mesh.dtypes import DTYPE_NAMES, parse_dtype
from automodel.mesh.sizes import ParallelismSizes, ResolvedLayout
from automodel.mesh.strategy_config import StrategyConfig

__all__ = [
    "Axis",
    "DTYPE_NAMES",
    "axes",
    "dense_axes",
    "flattened_axes",
    "moe_axes",
    "parallel_axes",
    "register_axis",
    "unregister_axis",
    "DistInfo",
    "LaunchEnv",
    "MeshContext",
    "ParallelismSizes",
    "ResolvedLayout",
    "StrategyConfig",
    "default_backend",
    "destroy_distributed",
    "detect_launch_env",
    "RendezvousError",
    "distributed_session",
    "fake_world",
    "init_distributed",
    "parse_dtype",
]
