"""Sessions: `tests` (CPU suite of every package and tests/), `gpu_tests` (tests marked gpu), `lint`.

All sessions run in the workspace environment (`uv run --frozen nox -s ...`), so torch is never
installed twice. `gpu_tests` also works on GPU runners that have torch preinstalled and no package
index: it puts every package's `src/` on PYTHONPATH instead of installing anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["tests", "lint"]

ROOT = Path(__file__).parent
PACKAGE_SRCS = sorted(str(p) for p in (ROOT / "packages").glob("*/src"))


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU suite; pytest exit code 5 (nothing collected) fails the session."""
    session.run(sys.executable, "-m", "pytest", "--durations=15", *session.posargs)


@nox.session
def gpu_tests(session: nox.Session) -> None:
    """Every `gpu`-marked test of every package; skips (with the reason) on a machine without CUDA."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0 or not probe.stdout.startswith("True"):
        session.skip(
            f"no CUDA device here (torch.cuda.is_available() -> {probe.stdout.strip() or probe.stderr[-200:]})"
        )
    env = {"PYTHONPATH": os.pathsep.join([*PACKAGE_SRCS, os.environ.get("PYTHONPATH", "")])}
    session.run(
        sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *session.posargs, env=env
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree."""
    session.run(sys.executable, "-m", "ruff", "check", ".")
    session.run(sys.executable, "-m", "ruff", "format", "--check", ".")
