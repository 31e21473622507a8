"""automodel.mesh: parallelism sizes, device meshes, process-group setup, model introspection."""

from automodel.mesh._version import __version__ as __version__
from automodel.mesh.axes import AXES, DENSE_AXES, FLATTENED_AXES, MOE_AXES, PARALLEL_AXES, Axis
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
    "AXES",
    "PARALLEL_AXES",
    "Axis",
    "DENSE_AXES",
    "DTYPE_NAMES",
    "FLATTENED_AXES",
    "MOE_AXES",
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
