"""Sessions: `tests` (CPU suite of every package and tests/), `gpu_tests` (tests marked gpu), `lint`,
`typecheck` (basedpyright over every file),
`build` (wheel + sdist per package, checked), `install_alone` (each wheel alone in a fresh venv,
imported, checked free of test code and smoke-run), `release_check` (versions, changelogs and release tags agree), `conformance`
(every causal LM of the transformers registry under every layout; writes docs/models.md), `torch_range`
(each package's tests in a fresh venv on the oldest and newest torch it admits), `composed`
(composed layouts on common families; writes docs/composed.md), `faults` (every fault and
bad-input case of the recipes and the pipeline package), `automodel_peer` (NeMo AutoModel 0.7.0 itself
vs `recipes train` on its own recipe files, CPU; installs it outside the repository).

All sessions run in the workspace environment (`uv run --frozen nox -s ...`), so torch is never
installed twice. `gpu_tests` runs scripts/gpu_check.sh, which also works on GPU runners that have
torch preinstalled and no nox, uv or package index: it puts every package's `src/` on PYTHONPATH
instead of installing anything (and wheels from `.whl/`, e.g. megatron-fsdp, into a temp dir).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["tests", "lint"]

ROOT = Path(__file__).parent


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU suite; pytest exit code 5 (nothing collected) fails the session."""
    session.run(sys.executable, "-m", "pytest", "--durations=30", *session.posargs)


@nox.session
def gpu_tests(session: nox.Session) -> None:
    """scripts/gpu_check.sh (gpu tests, then the GPU benchmark, one summary); skips without CUDA.

    Posargs go to pytest (`nox -s gpu_tests -- -k megatron`). On a GPU runner without nox or uv,
    run the script itself: `scripts/gpu_check.sh`.
    """
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.is_available(), torch.cuda.device_count())"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0 or not probe.stdout.startswith("True"):
        session.skip(
            f"no CUDA device here (torch.cuda.is_available() -> {probe.stdout.strip() or probe.stderr[-200:]})"
        )
    session.run(
        "bash", str(ROOT / "scripts" / "gpu_check.sh"), "--python", sys.executable, "--", *session.posargs,
        external=True,
    )  # fmt: skip


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint and format check over the whole tree."""
    session.run(sys.executable, "-m", "ruff", "check", ".")
    session.run(sys.executable, "-m", "ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """basedpyright over every file (packages' src and tests, torchrun workers, tests/, benchmarks/,
    scripts/): unresolved imports, unknown attributes and wrong calls fail here, not on the next GPU
    run. Settings in pyproject.toml's [tool.basedpyright]. Posargs go to basedpyright (e.g. paths)."""
    session.run(sys.executable, "-m", "basedpyright", "--threads", "2", *session.posargs)


@nox.session
def build(session: nox.Session) -> None:
    """Wheel + sdist of each of the eight packages into dist/ (`uv build --package ...`), checked.

    The wheel rebuilt from each sdist must equal the tree's (file list and hashes); `twine check
    --strict` (metadata, README rendering); LICENSE, py.typed, version and sibling bounds in each
    wheel. `nox -s build -- --out DIR` writes elsewhere. See scripts/dists.py.
    """
    session.run(sys.executable, str(ROOT / "scripts" / "dists.py"), "build", *session.posargs)


@nox.session
def install_alone(session: nox.Session) -> None:
    """Build (as `build`), then install each wheel alone into a fresh `uv venv` and smoke-run it.

    Only the package's declared dependencies: siblings from the just-built wheels, third-party
    packages at uv.lock's versions from the uv cache. Fails if an installed wheel holds test code
    (a test or harness module, an import of pytest or automodel.testing, a harness function: the
    harness lives in the dev-only packages/testing). `-- --only automodel-pipeline` limits it.
    .ci/run runs it. See scripts/dists.py and scripts/install_alone/.
    """
    session.run(sys.executable, str(ROOT / "scripts" / "dists.py"), "install-alone", *session.posargs)


@nox.session
def torch_range(session: nox.Session) -> None:
    """Each package's tests in a fresh venv outside the workspace, on the oldest and the newest torch
    its `torch` specifier admits (`-- --only automodel-pipeline --torch 2.15.0`; after a second `--`,
    pytest arguments). .ci/run runs mesh, pipeline, context-parallel and data on the newest torch.
    See scripts/torch_range.py."""
    session.run(sys.executable, str(ROOT / "scripts" / "torch_range.py"), *session.posargs)


@nox.session
def release_check(session: nox.Session) -> None:
    """Fail when a package changed since its last release tag (`<distribution>-v<version>`) without a
    version bump and a changelog entry, or lacks a CHANGELOG.md entry for its current version.
    See RELEASING.md and scripts/release_check.py."""
    session.run(sys.executable, str(ROOT / "scripts" / "release_check.py"))


@nox.session
def heavy(session: nox.Session) -> None:
    """The `heavy`-marked cases the CPU suite skips (each over a minute on 2 cores: inductor compiles)."""
    session.env["AUTOMODEL_HEAVY"] = "1"
    session.run(sys.executable, "-m", "pytest", "-q", "-m", "heavy", *session.posargs)


@nox.session
def stress(session: nox.Session) -> None:
    """Repeat the run-to-exit test of the real CLI 20 times (the CPU suite runs it twice)."""
    session.env["AUTOMODEL_CLEAN_EXIT_RUNS"] = "20"
    session.run(
        sys.executable, "-m", "pytest", "-q", "packages/recipes/tests/test_clean_exit.py", *session.posargs
    )


#: The fault suite: every case of issue 34 (launcher kill, locks, resume, one-line errors, signals,
#: corrupt checkpoints, bad data, pipeline pitfalls) plus the earlier fault tests.
FAULT_TESTS = (
    "packages/recipes/tests/test_faults.py",
    "packages/recipes/tests/test_faults_cli.py",
    "packages/recipes/tests/test_faults_refusals.py",
    "packages/recipes/tests/test_faults_data.py",
    "packages/recipes/tests/test_faults_launch.py",
    "packages/recipes/tests/test_faults_elastic.py",
    "packages/recipes/tests/test_cli_multinode.py",
    "packages/recipes/tests/test_run_safety.py",
    "packages/recipes/tests/test_config_errors.py",
    "packages/pipeline/tests/test_pitfalls.py",
)


@nox.session
def faults(session: nox.Session) -> None:
    """Every fault case (the CPU suite runs most of them; `AUTOMODEL_FAULTS=all` adds the slow rest)."""
    session.env["AUTOMODEL_FAULTS"] = "all"
    session.run(sys.executable, "-m", "pytest", "-q", *FAULT_TESTS, *session.posargs)


@nox.session
def conformance(session: nox.Session) -> None:
    """Every causal LM in transformers' registry, one process vs each layout; writes docs/models.md.

    Posargs go to the sweep (`nox -s conformance -- --models llama,gpt2 --layouts pp2`). The CPU
    suite runs a representative subset (tests/conformance/test_conformance.py); this is the full run.
    """
    session.run(sys.executable, str(ROOT / "tests" / "conformance" / "matrix.py"), *session.posargs)


@nox.session
def composed(session: nox.Session) -> None:
    """Composed 4-rank layouts (pipeline with TP, SP, CP, EP; EP with CP) on common families, one
    process vs each; writes docs/composed.md. Posargs go to the sweep (`-- --models llama,mixtral`)."""
    session.run(sys.executable, str(ROOT / "tests" / "conformance" / "composed.py"), *session.posargs)


@nox.session
def automodel_peer(session: nox.Session) -> None:
    """NeMo AutoModel 0.7.0 itself vs `recipes train` on its own recipe files (SQuAD full and LoRA,
    HellaSwag, chat), same tiny model, tokenizer and rows, CPU: per-step losses and step times side
    by side. Installs AutoModel in a venv outside the repository (~/.cache/automodel-peer) and patches
    it (benchmarks/automodel_0.7.0_cpu.patch). Not in .ci/run: it needs the registry and ~30 min.
    `nox -s automodel_peer -- --automodel-checkout PATH [--nproc 2] [--steps 10] [--files squad]`."""
    session.run(sys.executable, str(ROOT / "benchmarks" / "automodel_peer_cpu.py"), *session.posargs)
