"""A finished training exits 0, every time (issue 14, item 5).

Rank 1 of a 2-rank run sometimes died after its last step with ``terminate called without an
active exception`` (SIGABRT). Cause: gloo worker threads outlived the interpreter. A worker frees
the tensors of a finished collective after the rank has moved on, and takes the GIL to do so. If
that happens while the interpreter is finalizing, Python ends the thread inside a C++ ``noexcept``
destructor, and the process aborts. ``destroy_process_group()`` does not stop those threads: only
freeing the groups does, and torch's DTensor caches keep every device mesh, and so every group,
alive. `destroy_distributed` now frees them (see its docstring).

The race is rare (it needs a worker starved right before exit), so two tests: the condition, checked
deterministically in each rank after a real training; and the real CLI run repeatedly.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from _launch_helpers import clean_env  # noqa: E402
from _recipe_helpers import tiny_config  # noqa: E402

#: CLI runs of the exit stress test: 2 in the CPU suite; `nox -s stress` runs 20.
RUNS = int(os.environ.get("AUTOMODEL_CLEAN_EXIT_RUNS", "2"))


def _config(tmp_path: Path) -> Path:
    cfg = tiny_config(
        str(tmp_path / "run"),
        step_scheduler={"max_steps": 2, "val_every_steps": None},
        validation_dataset=None,
        checkpoint={"enabled": False},
        logging={"progress_bar": False},
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _recipes_executable() -> str:
    candidate = Path(sys.executable).with_name("recipes")
    return str(candidate) if candidate.exists() else "recipes"


RANK_SCRIPT = textwrap.dedent(
    """
    import sys, warnings, yaml
    from automodel.mesh import destroy_distributed
    from automodel.mesh.distributed import gloo_worker_threads
    from automodel.recipes import load_config
    from automodel.recipes.trainer import run_training

    result = run_training(load_config(yaml.safe_load(open(sys.argv[1]))))
    during = gloo_worker_threads()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the count below is the check
        destroy_distributed()
    print(f"RESULT steps={result.steps} workers_during={during} workers_after={gloo_worker_threads()}")
    """
)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads via /proc")
def test_teardown_joins_every_gloo_worker(tmp_path: Path) -> None:
    """After a real 2-rank training, `destroy_distributed` leaves no gloo worker thread running."""
    cfg = _config(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**clean_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(cfg)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for r, (p, (stdout, stderr)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r}:\n{stderr[-3000:]}"
        line = next((x for x in stdout.splitlines() if x.startswith("RESULT")), stdout)
        assert "steps=2" in line and "workers_during=0" not in line, f"rank {r}: {line}"
        assert line.endswith("workers_after=0"), f"rank {r}: gloo workers outlive the teardown: {line}"


@pytest.mark.slow
def test_two_rank_training_exits_0_every_time(tmp_path: Path) -> None:
    """The real CLI (torchrun, 2 gloo ranks, FSDP2), RUNS times, two at a time: every run exits 0.

    Two jobs at once on a small machine also starve threads the way the failure needed, and take
    about a quarter less wall time than one after the other.
    """
    cfg = _config(tmp_path)

    def launch(i: int) -> subprocess.Popen:
        cmd = [
            _recipes_executable(),
            "train",
            str(cfg),
            "--nproc-per-node",
            "2",
            f"--output_dir={tmp_path}/run{i}",
        ]
        with open(tmp_path / f"run{i}.stderr", "w") as err:  # a file: a full pipe would stall the job
            return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=clean_env(), cwd=tmp_path)

    failures = []
    for first in range(0, RUNS, 2):
        procs = {i: launch(i) for i in range(first, min(first + 2, RUNS))}
        for i, proc in procs.items():
            code = proc.wait(timeout=300)
            stderr = (tmp_path / f"run{i}.stderr").read_text()
            if code != 0 or "terminate called" in stderr or "outlive" in stderr:
                failures.append(f"--- run {i}: exit {code}\n{stderr[-2500:]}")
    assert not failures, f"{len(failures)} of {RUNS} runs did not exit cleanly:\n" + "\n".join(failures)
