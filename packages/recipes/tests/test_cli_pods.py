"""Kubernetes pods on loopback: `recipes train` in a pod whose RANK is its node index.

Kubeflow's PyTorchJob and Alibaba PAI-DLC give each pod RANK = the node's index and WORLD_SIZE
(PAI and older operators: the number of nodes; newer PyTorchJob operators: nodes x
PET_NPROC_PER_NODE), MASTER_ADDR / MASTER_PORT, and PET_NNODES / PET_NODE_RANK /
PET_NPROC_PER_NODE (PAI: NPROC_PER_NODE). Here: how each set of variables is read (with and
without the flags users write in such pods), and one real job of two "pods" x 2 ranks on loopback,
pod 0 with a PyTorchJob's variables and no flag, pod 1 with PAI-DLC's variables and the flags,
whose losses equal one node of 4 ranks (1e-6). One job covers both readers in a real run (each
pod reads only its own variables); the readings of every node index are checked without a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _launch_helpers import clean_env, finish, free_port, losses, start_train, write_config  # noqa: E402
from _recipe_helpers import preload, tiny_config  # noqa: E402

from automodel.recipes.launch_plan import LaunchOptions, plan_launch  # noqa: E402
from automodel.testing.ranks import run_on_ranks  # noqa: E402

STEPS = 3
TIMEOUT = 300
ADDR = "127.0.0.1"


def pytorchjob_env(node: int, *, port: int, nodes: int = 2, nproc: int = 2) -> dict[str, str]:
    """The variables a PyTorchJob operator (v1.7+) sets on pod `node` (0: the master replica)."""
    return {
        "RANK": str(node), "WORLD_SIZE": str(nodes * nproc), "MASTER_ADDR": ADDR, "MASTER_PORT": str(port),
        "PET_NNODES": str(nodes), "PET_NODE_RANK": str(node), "PET_NPROC_PER_NODE": str(nproc),
        "KUBERNETES_SERVICE_HOST": "10.96.0.1", "PYTHONUNBUFFERED": "0",
    }  # fmt: skip


def pai_env(node: int, *, port: int, nodes: int = 2, nproc: int = 2) -> dict[str, str]:
    """The variables PAI-DLC sets on node `node` of a PyTorch job."""
    return {
        "RANK": str(node), "WORLD_SIZE": str(nodes), "MASTER_ADDR": ADDR, "MASTER_PORT": str(port),
        "NPROC_PER_NODE": str(nproc),
    }  # fmt: skip


def written_flags(env: dict[str, str], *, nproc: int = 2) -> list[str]:
    """The torchrun flags users write in a PAI / older PyTorchJob pod, filled from its variables."""
    return [
        "--nproc-per-node", str(nproc), "--nnodes", env["WORLD_SIZE"], "--node-rank", env["RANK"],
        "--rdzv-endpoint", f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
    ]  # fmt: skip


def _flags(argv: list[str]) -> dict[str, object]:
    """`written_flags` as `plan_launch` gets them from argparse."""
    parsed = dict(zip(argv[::2], argv[1::2], strict=True))
    return {
        "nproc_per_node": int(parsed["--nproc-per-node"]),
        "nnodes": parsed["--nnodes"],
        "node_rank": int(parsed["--node-rank"]),
        "rdzv_endpoint": parsed["--rdzv-endpoint"],
    }


@pytest.mark.parametrize("node", [0, 1])
def test_pod_variables_are_read_as_the_node(node: int) -> None:
    """Each kind of pod, with no flag and with the flags users write: node `node` of 2 pods, 2 ranks
    each, meeting at MASTER_ADDR:MASTER_PORT; the line names the variables read."""
    port = free_port()
    expected = LaunchOptions(nproc_per_node=2, nnodes=2, node_rank=node, rdzv_endpoint=f"{ADDR}:{port}")
    pytorchjob = pytorchjob_env(node, port=port)
    pai = pai_env(node, port=port)
    older = {k: v for k, v in pytorchjob.items() if not k.startswith("PET_")} | {"WORLD_SIZE": "2"}
    cases = [
        (pytorchjob, {}, "Kubeflow PyTorchJob pod (PET_NNODES=2 PET_NODE_RANK="),
        # its WORLD_SIZE counts processes: the flags users write there take PET_NNODES for --nnodes
        (pytorchjob, _flags(written_flags(pai)), "Kubeflow PyTorchJob pod"),
        (pai, {}, "PAI-DLC pod (WORLD_SIZE=2 RANK="),
        (pai, _flags(written_flags(pai)), "PAI-DLC pod"),
        (older, {"nproc_per_node": 2}, "Kubernetes pod (WORLD_SIZE=2 RANK="),
        (older, _flags(written_flags(older)), "Kubernetes pod"),
    ]
    for env, flags, kind in cases:
        opts = plan_launch(flags, env)
        assert opts is not None and opts.environment is not None, (env, flags)
        assert opts == LaunchOptions(**{**expected.__dict__, "environment": opts.environment}), (env, flags)
        line = opts.environment
        assert line.startswith(f"recipes train: a {kind}"), line
        assert (
            f"node {node} of 2, 2 ranks here" in line and f"ranks {2 * node}-{2 * node + 1} of 4" in line
        ), line
        assert f"MASTER_ADDR={ADDR} MASTER_PORT={port}" in line and f"rendezvous at {ADDR}:{port}" in line, (
            line
        )


def test_pod_without_ranks_per_node_and_torchrun_ranks_in_pods() -> None:
    """No variable for the ranks per pod: --nproc-per-node, else 1 (never a silent count). A rank
    torchrun started inside a pod (LOCAL_RANK, GROUP_RANK, TORCHELASTIC_RUN_ID) trains in place."""
    port = free_port()
    older = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": ADDR, "MASTER_PORT": str(port),
             "KUBERNETES_SERVICE_HOST": "10.96.0.1"}  # fmt: skip
    opts = plan_launch({}, older)
    assert opts is not None and (opts.nproc_per_node, opts.nnodes, opts.node_rank) == (1, 2, 1)
    assert (
        opts.environment is not None
        and "1 rank here (no variable or flag: 1), rank 1 of 2" in opts.environment
    )
    for sign in ("LOCAL_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
        rank = {**pytorchjob_env(1, port=port), "RANK": "3", sign: "1"}
        assert plan_launch({}, rank) is None, sign
    # one pod, "auto" ranks per pod (PyTorchJob's default): the flag decides
    one = {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "PET_NNODES": "1",
        "PET_NODE_RANK": "0",
        "PET_NPROC_PER_NODE": "auto",
    }
    assert plan_launch({"nproc_per_node": 3}, one) == LaunchOptions(
        nproc_per_node=3, environment=plan_launch({"nproc_per_node": 3}, one).environment
    )


def _reference_on_rank(raw: dict) -> list[float]:
    from automodel.recipes import load_config
    from automodel.recipes.trainer import run_training

    return run_training(load_config(raw)).losses


def test_two_pods_train_as_one_node_of_four(tmp_path: Path) -> None:
    """Pod 0: a PyTorchJob's variables, `recipes train cfg.yaml`; pod 1: PAI-DLC's variables and the
    flags users write. Both print how they read their variables; 4 ranks train; losses (metrics.jsonl)
    equal one node's 4 forked ranks to 1e-6.

    ~60 s on 2 loaded cores (2 launchers, 2 agents, 4 ranks): the one real run of a pod's launch."""
    out = tmp_path / "run"
    config = write_config(tmp_path, out, steps=STEPS, checkpoint={"enabled": False})
    port = free_port()
    logs = [tmp_path / "pod0.stderr", tmp_path / "pod1.stderr"]
    procs = [
        start_train(config, log=logs[0], env=clean_env(**pytorchjob_env(0, port=port))),
        start_train(
            config, *written_flags(pai_env(1, port=port)), log=logs[1], env=clean_env(**pai_env(1, port=port))
        ),
    ]
    texts = finish(procs, logs, timeout=TIMEOUT)
    assert "recipes train: a Kubeflow PyTorchJob pod (PET_NNODES=2 PET_NODE_RANK=0" in texts[0], texts[0][
        -3000:
    ]
    assert "recipes train: a PAI-DLC pod (WORLD_SIZE=2 RANK=1" in texts[1], texts[1][-3000:]
    assert "[rank 3] fsdp2" in texts[1] and "[rank 1] fsdp2" in texts[0], texts  # 2 ranks on each pod
    preload()
    raw = tiny_config(
        str(tmp_path / "reference"),
        step_scheduler={"max_steps": STEPS, "val_every_steps": None},
        validation_dataset=None,
    )
    ref = run_on_ranks(_reference_on_rank, world_size=4, args=(raw,), timeout_s=TIMEOUT)[0]
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)), got
    for step in got:
        assert abs(got[step] - ref[step - 1]) <= 1e-6, f"step {step}: {got[step]} vs one node {ref[step - 1]}"
