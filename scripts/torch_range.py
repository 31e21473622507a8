"""Each package's tests on the oldest and the newest torch its range admits (`nox -s torch_range`).

    python scripts/torch_range.py                                   # every package, floor and newest
    python scripts/torch_range.py --only automodel-pipeline --torch 2.15.0
    python scripts/torch_range.py --ends newest --only automodel-mesh   # one end of each range
    python scripts/torch_range.py -- -k parity                      # after `--`: pytest arguments

The range a package declares (`torch>=2.11,<2.16`) is a claim; this is its test. For each package and
each torch version a fresh venv outside the workspace (`.nox/torch_range/<package>-torch<v>/`, uv
run from there so no workspace `pyproject.toml`, constraint or lock applies) gets:

- the package's wheel and the wheels of the siblings it declares (built as `nox -s build` does), with
  the extras its tests use (`TEST_EXTRAS`);
- `torch==<v>` (the CUDA build PyPI serves; the tests run on the CPU);
- the test tools (`TEST_TOOLS`: pytest, the dev-only harness `automodel-testing`, which the
  workspace's conftest.py imports, with the sibling wheels it requires (`HARNESS_SIBLINGS`), and what
  a package's tests import beyond its own dependencies);
- every other third-party package at uv.lock's version where the lock has it (torch and the CUDA
  libraries it pins excepted), so the torch version is the one thing that differs from the
  workspace.

Then the package's own tests (`packages/<folder>/tests`) run with that venv's python against the
installed wheels (pytest's importlib mode puts no source folder on the path; checked per venv).
The floor is the lowest release the package's `torch` specifier admits among FLOOR_CANDIDATES, the
newest the highest PyPI release it admits (`--torch` overrides both).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dists import (  # noqa: E402  (scripts/ is not a package)
    ROOT,
    _admits,
    _clean_env,
    _closure,
    _req_name,
    _run,
    _uv,
    build,
    workspace_packages,
)

#: torch releases a floor is chosen from (the lowest a package's specifier admits)
FLOOR_CANDIDATES = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")
#: extras of a package that its own tests exercise
TEST_EXTRAS = {
    "automodel-pipeline": "hf",
    "automodel-data": "hf,arrow,datasets",
    "automodel-recipes": "tensorboard,kernels,fp8,wandb,mlflow",
}
#: what every package's tests import besides the package: the test runner and the shared harness
#: (the workspace's conftest.py imports it, so every package's tests need it)
TEST_TOOLS = ("pytest", str(ROOT / "packages" / "testing"))
#: the harness's workspace dependencies: no index serves them, so their wheels are installed with it
#: (automodel-data's own closure lacks automodel-mesh; its tests import nothing of mesh)
HARNESS_SIBLINGS = ("automodel-mesh",)
#: per package, what its tests import that the package itself does not declare (from the dev group)
TEST_IMPORTS = {
    "automodel-mesh": ("transformers",),
    "automodel-fsdp2": ("transformers",),
    "automodel-megatron-fsdp-adapter": ("transformers",),
    "automodel-context-parallel": ("transformers",),
    "automodel-moe-ep": ("transformers",),
    "automodel-data": ("megatron-core",),
    "automodel-recipes": ("peft", "megatron-core"),
}
#: lock pins that belong to one torch build and must follow the torch under test (torch 2.11 caps
#: setuptools below the lock's version)
TORCH_BOUND = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|setuptools)$")


def pypi_torch_releases() -> list[str]:
    """torch's final releases on PyPI that ship a wheel, oldest first (the index's JSON API)."""
    with urllib.request.urlopen("https://pypi.org/pypi/torch/json", timeout=60) as response:
        data = json.load(response)
    releases = [v for v, files in data["releases"].items() if files and re.fullmatch(r"\d+\.\d+\.\d+", v)]
    return sorted(releases, key=lambda v: tuple(int(x) for x in v.split(".")))


def torch_spec(package_deps: tuple[str, ...]) -> str:
    req = next(r for r in package_deps if _req_name(r) == "torch")
    return req[len("torch") :].split(";")[0].strip()


def versions_for(spec: str, releases: list[str]) -> tuple[str, str]:
    """(floor, newest) of `spec` among the known releases."""
    admitted = [v for v in releases if _admits(spec, v)]
    if not admitted:
        sys.exit(f"no torch release on the index admits {spec!r}")
    floor = next((v for v in FLOOR_CANDIDATES if _admits(spec, v)), admitted[0])
    return floor, admitted[-1]


def lock_constraints(out: Path) -> Path:
    """uv.lock's third-party versions as constraints, minus what follows torch."""
    raw = out / "lock.txt"
    _run(
        [_uv(), "export", "--frozen", "--all-packages", "--no-emit-workspace", "--no-hashes", "--no-header",
         "--no-annotate", "--format", "requirements-txt", "-o", str(raw), "--quiet"]
    )  # fmt: skip
    kept = [
        line
        for line in raw.read_text().splitlines()
        if line.strip() and not line.startswith(("#", "-", " ")) and not TORCH_BOUND.match(_req_name(line))
    ]
    path = out / "constraints.txt"
    path.write_text("\n".join(kept) + "\n")
    return path


def run_one(
    *, name: str, folder: Path, wheels: dict[str, Path], torch_version: str, base: Path, constraints: Path,
    pytest_args: list[str],
) -> tuple[bool, float, str]:  # fmt: skip
    """Install `name` with `torch_version` in a fresh venv and run its tests; (passed, seconds, summary)."""
    uv, env = _uv(), _clean_env()
    t0 = time.perf_counter()
    root = base / f"{name}-torch{torch_version}"
    venv = root / "venv"
    root.mkdir(parents=True)
    python = venv / "bin" / "python"
    _run(
        [uv, "venv", "--quiet", "--no-config", "--no-project", "--python", sys.executable, str(venv)],
        cwd=root,
        env=env,
    )
    extras = TEST_EXTRAS.get(name)
    needed = _closure(name, wheels)
    needed += [n for n in HARNESS_SIBLINGS if n not in needed]
    wheel_args = [f"{wheels[n]}[{extras}]" if (n == name and extras) else str(wheels[n]) for n in needed]
    _run(
        [uv, "pip", "install", "--quiet", "--no-config", "--no-sources", "--python", str(python),
         "-c", str(constraints), f"torch=={torch_version}", *wheel_args, *TEST_TOOLS, *TEST_IMPORTS.get(name, ())],
        cwd=root, env=env, timeout=1800,
    )  # fmt: skip
    listed = {
        d["name"].lower(): d["version"]
        for d in json.loads(
            _run(
                [uv, "pip", "list", "--no-config", "--python", str(python), "--format", "json"],
                cwd=root,
                env=env,
            )
        )
    }
    got = listed.get("torch", "").split("+")[0]
    if got != torch_version:
        sys.exit(f"{name}: the venv holds torch {got!r}, not {torch_version}")
    run_env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
    run_env["OMP_NUM_THREADS"] = "1"
    module = next(p.module for p in workspace_packages() if p.name == name)
    where = subprocess.run(
        [str(python), "-I", "-c", f"import {module} as m; print(m.__file__)"],
        capture_output=True, text=True, cwd=root, env=run_env,
    ).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(venv.resolve()):
        sys.exit(f"{name}: {module} imports from {where!r}, not from the venv's installed wheel")
    install_s = time.perf_counter() - t0
    proc = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
         str(folder / "tests"), *pytest_args],
        cwd=ROOT, env=run_env, capture_output=True, text=True,
    )  # fmt: skip
    tail = [line for line in proc.stdout.splitlines() if line.strip()]
    summary = tail[-1] if tail else proc.stderr[-300:]
    if proc.returncode not in (0,):
        print(proc.stdout[-20000:], proc.stderr[-4000:], sep="\n", flush=True)
    seconds = time.perf_counter() - t0
    print(
        f"{name} on torch {torch_version}: {summary} (install {install_s:.0f} s, total {seconds:.0f} s)",
        flush=True,
    )
    return proc.returncode == 0, seconds, summary


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, pytest_args = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=None, help="these distributions only")
    ap.add_argument(
        "--torch", nargs="*", default=None, help="these torch versions instead of floor and newest"
    )
    ap.add_argument(
        "--ends", choices=["both", "floor", "newest"], default="both", help="which end of each range"
    )
    ap.add_argument("--out", type=Path, default=ROOT / ".nox" / "torch_range")
    args = ap.parse_args(argv)

    t_all = time.perf_counter()
    base: Path = args.out
    if base.exists():
        subprocess.run(["rm", "-rf", str(base)], check=True)
    base.mkdir(parents=True)
    built = build(base / "dist")
    wheels = {name: w for name, (w, _) in built.items()}
    constraints = lock_constraints(base)
    releases = pypi_torch_releases() if args.torch is None else []
    results: list[tuple[str, str, bool, float, str]] = []
    for p in workspace_packages():
        if args.only and p.name not in args.only:
            continue
        spec = torch_spec(p.dependencies)
        floor, newest = versions_for(spec, releases) if args.torch is None else ("", "")
        ends = {"both": [floor, newest], "floor": [floor], "newest": [newest]}[args.ends]
        versions = args.torch or list(dict.fromkeys(ends))
        for v in versions:
            ok, seconds, summary = run_one(
                name=p.name, folder=p.folder, wheels=wheels, torch_version=v, base=base,
                constraints=constraints, pytest_args=pytest_args,
            )  # fmt: skip
            results.append((p.name, v, ok, seconds, summary))
            subprocess.run(["rm", "-rf", str(base / f"{p.name}-torch{v}")], check=False)
    print(f"torch_range ({time.perf_counter() - t_all:.0f} s):")
    for name, v, ok, seconds, summary in results:
        print(f"  {'ok  ' if ok else 'FAIL'} {name:34s} torch {v:8s} {seconds:6.0f} s  {summary}")
    if not all(ok for *_, ok, _s, _m in results):
        sys.exit("torch_range: some package fails on a torch its range admits")


if __name__ == "__main__":
    main()
