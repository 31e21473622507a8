"""A Kubernetes pod's launch variables, read as the node they describe (not as one rank).

Kubeflow's PyTorchJob, Alibaba PAI-DLC and the torchrun wrappers written for them start one container
per node and give it ``RANK`` = the node's index, ``WORLD_SIZE`` (the number of nodes; newer
PyTorchJob operators count processes: nodes x ``PET_NPROC_PER_NODE``), ``MASTER_ADDR`` /
``MASTER_PORT`` (node 0's service), and torchrun's own defaults ``PET_NNODES``, ``PET_NODE_RANK``,
``PET_NPROC_PER_NODE`` (``PET_MASTER_ADDR`` / ``PET_MASTER_PORT`` with some operators); PAI-DLC sets
``NPROC_PER_NODE``. A rank torchrun started has ``RANK`` / ``WORLD_SIZE`` too, but also
``LOCAL_RANK``, ``GROUP_RANK`` or ``TORCHELASTIC_RUN_ID``, which no pod has.

A sign of a pod (`pod_kind`), when no torchrun variable is set:

- any of torchrun's ``PET_`` launch variables (`PET_VARIABLES`): a PyTorchJob or a torchrun wrapper;
- ``RANK`` and ``WORLD_SIZE`` with ``NPROC_PER_NODE``: PAI-DLC;
- ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` with ``KUBERNETES_SERVICE_HOST``
  (which Kubernetes sets in every container): a PyTorchJob of an operator without ``PET_`` variables.

``RANK`` / ``WORLD_SIZE`` with none of these (a notebook's or a job script's leftovers) is no pod:
`launch_plan` treats them as before (a rank in place; a launcher flag refused naming them).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from automodel.recipes.errors import ConfigError

#: What torchrun sets in every rank it starts and no pod has: with RANK/WORLD_SIZE, a torchrun rank.
TORCHRUN_RANK_VARIABLES = ("LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID")
#: torchrun's launch defaults an operator sets on a pod (torch.distributed.run reads ``PET_<FLAG>``).
PET_VARIABLES = ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE", "PET_MASTER_ADDR", "PET_MASTER_PORT")
#: Every variable a pod's reading may name, in the order its line lists them.
POD_VARIABLES = (
    *PET_VARIABLES, "NPROC_PER_NODE", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "KUBERNETES_SERVICE_HOST",
)  # fmt: skip


@dataclass(frozen=True)
class PodLaunch:
    """The node a pod's variables describe: what its `recipes train` starts and where it meets the others."""

    #: Ranks to start on this pod (None: no variable says; the flag or 1 decides).
    nproc_per_node: int | None
    nnodes: int
    node_rank: int
    #: HOST:PORT of node 0 (None: one pod, or not given).
    endpoint: str | None
    #: Which variable gave each value (``"nnodes": "PET_NNODES=2"``), for the line and the refusals.
    sources: Mapping[str, str]
    #: "Kubeflow PyTorchJob pod", "PAI-DLC pod" or "Kubernetes pod".
    kind: str
    #: `nproc_per_node` was counted for ``auto`` / ``gpu`` / ``cpu`` (--nproc-per-node overrides it).
    nproc_counted: bool = False


def is_torchrun_rank(env: Mapping[str, str]) -> bool:
    """RANK and WORLD_SIZE with a variable only torchrun sets in the ranks it starts."""
    return "RANK" in env and "WORLD_SIZE" in env and any(n in env for n in TORCHRUN_RANK_VARIABLES)


def pod_kind(env: Mapping[str, str]) -> str | None:
    """The kind of pod `env` is (see the module docstring), or None: no sign of a pod."""
    if is_torchrun_rank(env):
        return None
    if any(n in env for n in PET_VARIABLES):
        return "Kubeflow PyTorchJob pod"
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    if "NPROC_PER_NODE" in env:
        return "PAI-DLC pod"
    if "KUBERNETES_SERVICE_HOST" in env and "MASTER_ADDR" in env and "MASTER_PORT" in env:
        return "Kubernetes pod"
    return None


def _int_var(env: Mapping[str, str], name: str, *, minimum: int) -> int:
    raw = env[name]
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(name, raw, f"must be an int >= {minimum} (a variable of this pod's environment)")
    return value


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """(name, value) of the first of `names` set, after checking that the others set agree with it."""
    present = [(n, env[n]) for n in names if n in env]
    for name, value in present[1:]:
        if value.strip() != present[0][1].strip():
            raise ConfigError(
                name,
                value,
                f"disagrees with {present[0][0]}={present[0][1]!r}: the pod's variables must agree",
            )
    return present[0] if present else None


def _nproc(env: Mapping[str, str]) -> tuple[int | None, str | None, bool]:
    """(the ranks per node the pod's variables ask for, as torchrun reads ``--nproc-per-node``,
    the variable, whether it was counted from ``auto`` / ``gpu`` / ``cpu``)."""
    found = _first(env, "PET_NPROC_PER_NODE", "NPROC_PER_NODE")
    if found is None:
        return None, None, False
    name, raw = found
    word = raw.strip().lower()
    if word not in ("auto", "gpu", "cpu"):
        return _int_var(env, name, minimum=1), f"{name}={raw}", False
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if word == "gpu" and not cuda:
        raise ConfigError(name, raw, "counts CUDA GPUs, and this pod has none; give --nproc-per-node N")
    if word == "cpu" or not cuda:  # torchrun's "auto" without a GPU: the CPU count
        return os.cpu_count() or 1, f"{name}={raw} (the CPU count, as torchrun counts it)", True
    return cuda, f"{name}={raw} (the CUDA GPUs)", True


def read_pod(env: Mapping[str, str]) -> PodLaunch | None:
    """The node this pod is (None without a sign of a pod); `ConfigError` naming the variable when
    its variables are malformed or contradict each other."""
    kind = pod_kind(env)
    if kind is None:
        return None
    sources: dict[str, str] = {}
    nproc, nproc_source, counted = _nproc(env)
    if nproc_source is not None:
        sources["nproc_per_node"] = nproc_source
    nnodes_var = "PET_NNODES" if "PET_NNODES" in env else "WORLD_SIZE" if "WORLD_SIZE" in env else None
    if nnodes_var is None:
        nnodes = 1
    elif ":" in env[nnodes_var]:
        raise ConfigError(
            nnodes_var,
            env[nnodes_var],
            "is an elastic MIN:MAX range (a PyTorchJob's elasticPolicy), which `recipes train` does not "
            "read in a pod; give the job a fixed number of replicas (for an elastic job, start `recipes "
            "train --nnodes MIN:MAX --rdzv-endpoint HOST:PORT --max-restarts N` on each node yourself)",
        )
    else:
        nnodes = _int_var(env, nnodes_var, minimum=1)
        sources["nnodes"] = f"{nnodes_var}={env[nnodes_var]}"
    if nnodes_var == "PET_NNODES" and "WORLD_SIZE" in env:
        world = _int_var(env, "WORLD_SIZE", minimum=1)
        world_sizes = {nnodes, nnodes * (nproc or 1)}
        if world not in world_sizes:
            raise ConfigError(
                "WORLD_SIZE",
                env["WORLD_SIZE"],
                f"is neither PET_NNODES={env['PET_NNODES']} (the pods) nor PET_NNODES x the ranks per pod "
                f"({nnodes * (nproc or 1)}): the pod's variables disagree",
            )
    rank_found = _first(env, "PET_NODE_RANK", "RANK")
    if rank_found is None:
        if nnodes > 1:
            raise ConfigError(
                nnodes_var or "PET_NNODES",
                env.get(nnodes_var or "PET_NNODES"),
                "says several pods, but neither PET_NODE_RANK nor RANK says which one this is",
            )
        node_rank = 0
    else:
        node_rank = _int_var(env, rank_found[0], minimum=0)
        sources["node_rank"] = f"{rank_found[0]}={rank_found[1]}"
        if node_rank >= nnodes:
            raise ConfigError(
                rank_found[0], rank_found[1], f"must be < {sources.get('nnodes', 'the number of pods')}"
            )
    endpoint = _endpoint(env, sources, required=nnodes > 1)
    return PodLaunch(
        nproc_per_node=nproc,
        nnodes=nnodes,
        node_rank=node_rank,
        endpoint=endpoint,
        sources=sources,
        kind=kind,
        nproc_counted=counted,
    )


def _endpoint(env: Mapping[str, str], sources: dict[str, str], *, required: bool) -> str | None:
    addr = _first(env, "PET_MASTER_ADDR", "MASTER_ADDR")
    port = _first(env, "PET_MASTER_PORT", "MASTER_PORT")
    if addr is None or port is None:
        if required:
            missing = "MASTER_ADDR" if addr is None else "MASTER_PORT"
            raise ConfigError(
                missing,
                None,
                "is not set, and this pod is one of several: node 0's address and port are needed",
            )
        return None
    number = _int_var(env, port[0], minimum=1)
    if number > 65535:
        raise ConfigError(port[0], port[1], "must be a port (1-65535)")
    if not addr[1].strip():
        raise ConfigError(addr[0], addr[1], "is empty: it must name node 0's host")
    sources["rdzv_endpoint"] = f"{addr[0]}={addr[1]} {port[0]}={port[1]}"
    host = addr[1].strip()
    return f"[{host}]:{number}" if ":" in host else f"{host}:{number}"
