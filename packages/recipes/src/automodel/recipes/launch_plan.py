"""Who starts the ranks of `recipes train`: the launch model, and the refusals that keep it one.

Two ways, never mixed:

(a) a launcher already started every rank: torchrun (RANK and WORLD_SIZE set) or `srun` (a task:
    SLURM_PROCID and SLURM_STEP_ID set, see `automodel.mesh.distributed.is_srun_task`). The CLI is
    one rank and trains in place; a launcher flag of its own is refused, whatever its value: the
    ranks exist already, and a flag equal to the environment's numbers cannot be told from a
    stale RANK/WORLD_SIZE of a notebook or job script (the job would wait for ranks nobody starts).
(b) the CLI is the launcher (no launcher variables, or the environment describes one process:
    WORLD_SIZE=1, SLURM_NTASKS=1, an ``sbatch`` shell): ``--nproc-per-node`` ranks on this node,
    ``--nnodes N --node-rank R --rdzv-endpoint HOST:PORT`` (all three) across nodes; or a Kubernetes
    pod (`automodel.recipes.pod_env`: a PyTorchJob's or PAI-DLC's RANK = node index): the node its
    variables describe, where a launcher flag given must agree with them.

Every refusal is a `ConfigError` raised before anything starts: one line, exit code 2.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from automodel.mesh import detect_launch_env
from automodel.recipes.errors import ConfigError
from automodel.recipes.pod_env import PodLaunch, is_torchrun_rank, read_pod

#: Launcher flags of `recipes train` (argparse dest -> flag); None in the parsed args when not given.
LAUNCHER_FLAGS = {
    "nproc_per_node": "--nproc-per-node",
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "rdzv_endpoint": "--rdzv-endpoint",
    "rdzv_id": "--rdzv-id",
    "rdzv_timeout": "--rdzv-timeout",
    "max_restarts": "--max-restarts",
}

#: torchrun's default rendezvous timeout (s): how long the nodes wait for each other to join.
DEFAULT_RDZV_TIMEOUT = 600


@dataclass(frozen=True)
class LaunchOptions:
    """The CLI as launcher: what torchrun's agent on this node is asked to do."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0 (nnodes > 1)
    rdzv_id: str | None = None
    rdzv_timeout: int = DEFAULT_RDZV_TIMEOUT
    max_restarts: int = 0
    #: On a pod: the one line saying how its variables were read (None elsewhere).
    environment: str | None = None
    #: ``--nnodes MIN:MAX``: MIN (`nnodes` is MAX); None for a fixed number of nodes.
    min_nnodes: int | None = None

    @property
    def elastic(self) -> bool:
        return self.min_nnodes is not None

    @property
    def multi_process(self) -> bool:
        return self.nproc_per_node > 1 or self.nnodes > 1

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def plan_launch(flags: Mapping[str, object], env: Mapping[str, str] | None = None) -> LaunchOptions | None:
    """None when this process is a rank of a job torchrun or srun started (train in place); else the
    options of the CLI as launcher. `flags`: the launcher flags as parsed (None: not given)."""
    env = os.environ if env is None else env
    given = {key: value for key, value in flags.items() if value is not None}
    _refuse_partial_torchrun_env(env)
    pod = read_pod(env)
    if pod is not None:
        return _pod_options(pod, given)
    launch = detect_launch_env(env)
    if launch.launcher != "single" and (launch.world_size > 1 or not given):
        if given:
            key, value = next(iter(given.items()))
            raise ConfigError(LAUNCHER_FLAGS[key], value, _already_launched(env, launch.launcher))
        return None
    return _launcher_options(given)


def _refuse_partial_torchrun_env(env: Mapping[str, str]) -> None:
    present = [name for name in ("RANK", "WORLD_SIZE") if name in env]
    if len(present) == 1:
        other = "WORLD_SIZE" if present[0] == "RANK" else "RANK"
        raise ConfigError(
            present[0],
            env[present[0]],
            f"is set but {other} is not (torchrun sets both): a leftover of another job? "
            f"unset {present[0]}, or set {other} too to run as one rank of a job",
        )


def _already_launched(env: Mapping[str, str], launcher: str) -> str:
    if launcher == "torchrun":
        names = " ".join(f"{n}={env[n]}" for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if n in env)
        if is_torchrun_rank(env):
            what = f"this process is already one rank of a torchrun job ({names})"
        else:  # no pod either: a leftover of a notebook or job script, or a launcher of its own
            what = (
                f"{names} make this process one rank of a job (no sign of a pod: no PET_* variable, "
                "NPROC_PER_NODE or KUBERNETES_SERVICE_HOST)"
            )
        return (
            f"{what}, which starts no ranks; "
            "unset RANK and WORLD_SIZE for `recipes train` to start the ranks, or drop the flag to run as this rank"
        )
    names = " ".join(
        f"{n}={env[n]}"
        for n in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_STEP_ID")
        if n in env
    )
    return (
        f"this process is already one task of srun ({names}), which starts no ranks; drop the flag and let "
        "srun start every rank (srun --ntasks-per-node N), or run one task (srun --ntasks 1) for "
        "`recipes train` to start them"
    )


def _pod_options(pod: PodLaunch, given: Mapping[str, object]) -> LaunchOptions:
    """The node a pod's variables describe. A flag given must say the same; it decides only what no
    variable fixes (the ranks per pod when none is set or it is ``auto``)."""
    env_values: dict[str, object] = {"nnodes": pod.nnodes, "node_rank": pod.node_rank}
    if pod.nproc_per_node is not None and not pod.nproc_counted:
        env_values["nproc_per_node"] = pod.nproc_per_node
    if pod.endpoint is not None and pod.nnodes > 1:
        env_values["rdzv_endpoint"] = pod.endpoint
    for key, value in env_values.items():
        if key in given and not _same(key, given[key], value):
            hint = (
                " (a PyTorchJob's WORLD_SIZE counts processes, pods x PET_NPROC_PER_NODE; --nnodes counts pods)"
                if key == "nnodes" and pod.sources[key].startswith("PET_NNODES=")
                else ""
            )
            raise ConfigError(
                LAUNCHER_FLAGS[key],
                given[key],
                f"disagrees with this {pod.kind}'s {pod.sources[key]}{hint}: drop the flag, or make it agree",
            )
    if pod.nnodes == 1 and "rdzv_endpoint" in given:
        parse_endpoint(str(given["rdzv_endpoint"]))  # unused on one pod, but it must be well-formed
    if "nproc_per_node" in given or pod.nproc_per_node is None:
        nproc = _int_at_least(given, "nproc_per_node", 1, default=1)
        nproc_from = "--nproc-per-node" if "nproc_per_node" in given else "no variable or flag: 1"
    else:
        nproc, nproc_from = pod.nproc_per_node, pod.sources["nproc_per_node"]
    max_restarts = _int_at_least(given, "max_restarts", 0, default=0)
    timeout = _int_at_least(given, "rdzv_timeout", 1, default=DEFAULT_RDZV_TIMEOUT)
    endpoint = None
    if pod.nnodes > 1:
        assert pod.endpoint is not None  # read_pod requires it for several pods
        endpoint = pod.endpoint
        if pod.node_rank == 0:  # node 0 hosts the rendezvous on that port
            check_port_free(endpoint, parse_endpoint(endpoint)[1])
    return LaunchOptions(
        nproc_per_node=nproc,
        nnodes=pod.nnodes,
        node_rank=pod.node_rank,
        rdzv_endpoint=endpoint,
        rdzv_id=None if given.get("rdzv_id") is None else str(given["rdzv_id"]),
        rdzv_timeout=timeout,
        max_restarts=max_restarts,
        environment=_pod_line(pod, nproc=nproc, nproc_from=nproc_from),
    )


def _same(key: str, flag: object, value: object) -> bool:
    if key == "rdzv_endpoint":
        return parse_endpoint(str(flag)) == parse_endpoint(str(value))
    return str(flag).strip() == str(value)


def _pod_line(pod: PodLaunch, *, nproc: int, nproc_from: str) -> str:
    """The one line a pod's `recipes train` prints: the variables it read and the node they make."""
    read = " ".join(pod.sources[k] for k in ("nnodes", "node_rank", "rdzv_endpoint") if k in pod.sources)
    first = pod.node_rank * nproc
    ranks = f"rank {first}" if nproc == 1 else f"ranks {first}-{first + nproc - 1}"
    where = f", rendezvous at {pod.endpoint}" if pod.nnodes > 1 else ""
    return (
        f"recipes train: a {pod.kind} ({read or 'one pod'}): node {pod.node_rank} of {pod.nnodes}, "
        f"{nproc} rank{'s' if nproc > 1 else ''} here ({nproc_from}), {ranks} of {nproc * pod.nnodes}{where}"
    )


def _launcher_options(given: Mapping[str, object]) -> LaunchOptions:
    """Check the flags of the CLI as launcher (every rule before anything starts)."""
    nproc = _int_at_least(given, "nproc_per_node", 1, default=1)
    nnodes_raw = given.get("nnodes", "1")
    if ":" in str(nnodes_raw):
        return _elastic_options(given, nproc=nproc)
    try:
        nnodes = int(str(nnodes_raw))
    except ValueError:
        raise ConfigError(
            "--nnodes", nnodes_raw, "must be the number of nodes (an int) or an elastic range MIN:MAX"
        ) from None
    if nnodes < 1:
        raise ConfigError("--nnodes", nnodes, "must be >= 1")
    max_restarts = _int_at_least(given, "max_restarts", 0, default=0)
    timeout = _int_at_least(given, "rdzv_timeout", 1, default=DEFAULT_RDZV_TIMEOUT)
    if nnodes == 1:
        for key in ("node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_timeout"):
            if key in given:
                raise ConfigError(
                    LAUNCHER_FLAGS[key],
                    given[key],
                    "is for several nodes: give it with --nnodes N (N > 1), or drop it",
                )
        return LaunchOptions(nproc_per_node=nproc, max_restarts=max_restarts)
    missing = [LAUNCHER_FLAGS[k] for k in ("node_rank", "rdzv_endpoint") if k not in given]
    if missing:
        others = "1" if nnodes == 2 else f"1..{nnodes - 1}"
        raise ConfigError(
            "--nnodes",
            nnodes,
            f"needs {' and '.join(missing)}: run `recipes train ... --nnodes {nnodes} --node-rank R "
            "--rdzv-endpoint HOST:PORT` on every node, R = 0 on the node at HOST (it hosts the "
            f"rendezvous on the free port PORT) and {others} on the others",
        )
    node_rank = _int_at_least(given, "node_rank", 0, default=0)
    if node_rank >= nnodes:
        raise ConfigError(
            "--node-rank", node_rank, f"must be < --nnodes ({nnodes}): the nodes are 0..{nnodes - 1}"
        )
    endpoint = str(given["rdzv_endpoint"])
    host, port = parse_endpoint(endpoint)
    if node_rank == 0:
        check_port_free(endpoint, port)
    return LaunchOptions(
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        rdzv_endpoint=f"{host}:{port}",
        rdzv_id=None if given.get("rdzv_id") is None else str(given["rdzv_id"]),
        rdzv_timeout=timeout,
        max_restarts=max_restarts,
    )


def _elastic_options(given: Mapping[str, object], *, nproc: int) -> LaunchOptions:
    """``--nnodes MIN:MAX``: torch's c10d rendezvous at --rdzv-endpoint; the nodes take their ranks
    in the order they join, and a node lost costs one of --max-restarts."""
    raw = str(given["nnodes"])
    low, _, high = raw.partition(":")
    try:
        min_nodes, max_nodes = int(low), int(high)
    except ValueError:
        min_nodes = max_nodes = 0
    if not 1 <= min_nodes < max_nodes:
        raise ConfigError("--nnodes", raw, "an elastic range must be MIN:MAX with 1 <= MIN < MAX")
    if "node_rank" in given:
        raise ConfigError(
            "--node-rank",
            given["node_rank"],
            "is not used with an elastic --nnodes MIN:MAX (the nodes take their ranks in the order they join); drop it",
        )
    if "rdzv_endpoint" not in given:
        raise ConfigError(
            "--nnodes",
            raw,
            "needs --rdzv-endpoint HOST:PORT (the same on every node; the node at HOST hosts the rendezvous, "
            "and the job ends if that node is lost)",
        )
    max_restarts = _int_at_least(given, "max_restarts", 0, default=0)
    if max_restarts < 1:
        raise ConfigError(
            "--nnodes",
            raw,
            "needs --max-restarts N >= 1: each node lost restarts the others once (a node joining costs none)",
        )
    host, port = parse_endpoint(str(given["rdzv_endpoint"]))
    return LaunchOptions(
        nproc_per_node=nproc,
        nnodes=max_nodes,
        min_nnodes=min_nodes,
        rdzv_endpoint=f"{host}:{port}",
        rdzv_id=None if given.get("rdzv_id") is None else str(given["rdzv_id"]),
        rdzv_timeout=_int_at_least(given, "rdzv_timeout", 1, default=DEFAULT_RDZV_TIMEOUT),
        max_restarts=max_restarts,
    )


def _int_at_least(given: Mapping[str, object], key: str, minimum: int, *, default: int) -> int:
    value = given.get(key, default)
    if not isinstance(value, int) or value < minimum:
        raise ConfigError(LAUNCHER_FLAGS[key], value, f"must be an int >= {minimum}")
    return value


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[IPv6]:PORT`` too) -> (host, port); `ConfigError` naming --rdzv-endpoint."""
    host, sep, port_text = endpoint.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(
            "--rdzv-endpoint",
            endpoint,
            "must be HOST:PORT (node 0's address and a free port, e.g. node0:29500)",
        )
    return host, int(port_text)


def check_port_free(endpoint: str, port: int) -> None:
    """Node 0 hosts the rendezvous on `port` (on every address of this machine): refuse a port in use."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port is free
        try:
            probe.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise ConfigError(
                    "--rdzv-endpoint", endpoint, f"port {port} cannot be opened: {e.strerror}"
                ) from None
            raise ConfigError(
                "--rdzv-endpoint",
                endpoint,
                f"port {port} is in use on this machine, and node 0 (this node) hosts the rendezvous "
                "there; pick a free port (the same on every node)",
            ) from None
