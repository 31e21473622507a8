"""Install check: the wheels of automodel-mesh and automodel-pipeline, in a fresh venv holding
torch and nothing else of this workspace, run the README's 2-rank example under torchrun.

torch and its dependencies come from uv's cache at the versions pinned in uv.lock (offline),
the two packages from wheels built with `uv build`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
README = Path(__file__).resolve().parents[1] / "README.md"


def _run(cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: float = 300) -> str:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    return blocks[0]


def _reference_loss() -> float:
    """The example's loss computed in one process (same seed, same data, whole batch)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        loss = ((model(x) - y) ** 2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.item()


def test_wheels_install_alone_and_run_readme_example(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    assert uv is not None, "the install check needs the uv executable on PATH"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "VIRTUAL_ENV", "PYTHON"))}
    wheels, venv = tmp_path / "wheels", tmp_path / "venv"
    for package in ("automodel-mesh", "automodel-pipeline"):
        _run(
            [uv, "build", "--offline", "--package", package, "--wheel", "--out-dir", str(wheels)],
            env=env,
            cwd=ROOT,
        )
    # third-party dependencies of automodel-pipeline (torch & co.) as pinned in uv.lock. numpy (torch's
    # pipelining exchanges stage shapes with send/recv_object_list) is declared in pyproject.toml; until
    # uv.lock records that, it arrives with the hf extra's dependencies, transformers itself left out.
    sync_env = {**env, "UV_PROJECT_ENVIRONMENT": str(venv)}
    _run(
        [
            uv,
            "sync",
            "--frozen",
            "--offline",
            "--no-dev",
            "--package",
            "automodel-pipeline",
            "--no-install-workspace",
            "--extra",
            "hf",
            "--no-install-package",
            "transformers",
        ],
        env=sync_env,
        cwd=ROOT,
    )
    python = venv / "bin" / "python"
    _run(
        [
            uv,
            "pip",
            "install",
            "--offline",
            "--no-deps",
            "--python",
            str(python),
            *map(str, wheels.glob("*.whl")),
        ],
        env=env,
        cwd=tmp_path,
    )

    probe = (
        "import importlib.util, automodel.mesh, automodel.pipeline\n"
        "print(automodel.pipeline.__file__)\n"
        "print([m for m in ('transformers', 'automodel.fsdp2', 'automodel.recipes') if importlib.util.find_spec(m)])\n"
    )
    lines = _run([str(python), "-I", "-c", probe], env=env, cwd=tmp_path).strip().splitlines()
    assert Path(lines[-2]).is_relative_to(venv), lines
    assert lines[-1] == "[]", f"the fresh venv sees more than torch + the two wheels: {lines[-1]}"

    script = tmp_path / "example.py"
    script.write_text(_readme_example())
    out = _run(
        [str(python), "-I", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        env={**env, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    # Both ranks share one stdout pipe: a rank's newline can land after the other rank's line, so
    # each figure is matched by its own printed shape, not by what separates it from the next.
    losses = {int(r): float(v) for r, v in re.findall(r"rank (\d) loss (-?\d+\.\d{6})", out)}
    assert sorted(losses) == [0, 1], out
    expected = _reference_loss()
    for rank, value in losses.items():
        assert abs(value - expected) <= 1e-5 * abs(expected), (rank, value, expected)
