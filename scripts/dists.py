"""Build, check and install-alone the eight distributions (the `build` and `install_alone` nox sessions).

    python scripts/dists.py build [--out DIR]          # wheel + sdist per package, checked
    python scripts/dists.py install-alone [--out DIR]  # build, then each wheel alone in a fresh venv

build: `uv build --package NAME --sdist --wheel --no-sources` per package into DIR (default
`dist/`), then for every package: a wheel built from its sdist has the same files with the same
hashes as the wheel built from the tree; the wheel's METADATA names the pyproject's version,
ships LICENSE and py.typed and no `automodel/__init__.py` (PEP 420 namespace); every sibling
requirement admits the sibling's current version; `twine check --strict` (metadata, README
rendering) passes on all sixteen files.

install-alone: for each package a fresh `uv venv` under `.nox/install_alone/<name>/` gets the
package's wheel plus the wheels of the siblings it declares (transitively), all passed by path
(never an index), and the third-party dependencies those wheels declare, resolved by
`uv pip install` with the versions of uv.lock as constraints (torch 2.13 as locked; the wheels
come from the uv cache that `uv sync` filled, hard-linked: nothing is downloaded twice). Then
`uv pip check`, a check that exactly the expected automodel distributions are present (and
transformers only where required), an import from the venv (`python -I`: no workspace path)
that reports the pyproject's `__version__`, a check that none of the installed automodel wheels
holds test code (`wheel_test_code`), and the package's smoke script
(scripts/install_alone/smoke_<module>.py; see each for what it runs).

A package whose pyproject carries the classifier `Private :: Do Not Upload` (packages/testing, the
dev-only test harness) is no distribution: it is neither built nor installed alone.
"""

from __future__ import annotations

import argparse
import ast
import email.message
import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "scripts" / "install_alone"
#: The dev-only test harness (automodel.testing): never published, never in a wheel.
HARNESS = ROOT / "packages" / "testing" / "src" / "automodel" / "testing"
#: PyPI refuses an upload with this classifier; a package that carries it is not a distribution.
PRIVATE = "Private :: Do Not Upload"
#: Third-party tools a package's smoke script needs besides the package (installed after the checks
#: that the venv holds the package's own closure only): automodel-data's README example writes its
#: corpus with megatron-core's builder.
SMOKE_TOOLS = {"automodel-data": ("megatron-core",)}
#: Module names that are test code wherever they appear (besides ``test_*`` and the harness's own).
TEST_MODULES = frozenset({"testing", "conftest", "tests", "test"})


@dataclass(frozen=True)
class Package:
    name: str  # distribution name, automodel-<folder>
    folder: Path
    module: str  # automodel.<module>
    version: str
    dependencies: tuple[str, ...]

    @property
    def wheel_stem(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}"


def workspace_packages() -> list[Package]:
    out = []
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        if PRIVATE in project.get("classifiers", []):
            continue
        module = data["tool"]["uv"]["build-backend"]["module-name"]
        out.append(
            Package(
                name=project["name"],
                folder=pyproject.parent,
                module=module,
                version=project["version"],
                dependencies=tuple(project.get("dependencies", [])),
            )
        )
    return out


def _req_name(req: str) -> str:
    return re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1).lower().replace("_", "-")


def _run(cmd: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"FAILED ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def _uv() -> str:
    uv = shutil.which("uv")
    if uv is None:
        sys.exit("uv is not on PATH")
    return uv


def _clean_env() -> dict[str, str]:
    """The environment without the workspace's venv / uv project settings."""
    drop = ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "PYTHONPATH", "PYTHONHOME", "CONDA_PREFIX")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT / ".venv"))
    )
    return env


def _wheel_digest(path: Path) -> dict[str, str]:
    with zipfile.ZipFile(path) as z:
        return {i.filename: hashlib.sha256(z.read(i)).hexdigest() for i in z.infolist() if not i.is_dir()}


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(z.read(name).decode())


def _admits(spec: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(spec).contains(version, prereleases=True)


def build(out: Path) -> dict[str, tuple[Path, Path]]:
    """Build and check every package; returns {name: (wheel, sdist)}."""
    uv = _uv()
    packages = workspace_packages()
    versions = {p.name: p.version for p in packages}
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    built: dict[str, tuple[Path, Path]] = {}
    problems: list[str] = []
    # Both builds through the PEP 517 hook of the uv_build that build-system.requires resolves to, as
    # pip or any other frontend would (uv's built-in copy of the backend writes its own version into
    # WHEEL's Generator line, so tree and sdist builds would differ by that line alone).
    build_cmd = [uv, "build", "--quiet", "--no-sources", "--force-pep517"]
    with tempfile.TemporaryDirectory(prefix="from-sdist-") as tmp:
        for p in packages:
            _run([*build_cmd, "--package", p.name, "--sdist", "--wheel", "--out-dir", str(out)])
            wheel, sdist = out / f"{p.wheel_stem}-py3-none-any.whl", out / f"{p.wheel_stem}.tar.gz"
            if not (wheel.is_file() and sdist.is_file()):
                sys.exit(
                    f"{p.name}: expected {wheel.name} and {sdist.name} in {out}: {sorted(os.listdir(out))}"
                )
            built[p.name] = (wheel, sdist)
            # the sdist must build the same wheel: same files, same bytes
            again_dir = Path(tmp) / p.name
            _run([*build_cmd, str(sdist), "--wheel", "--out-dir", str(again_dir)])
            a, b = _wheel_digest(wheel), _wheel_digest(again_dir / wheel.name)
            if a != b:
                diff = sorted(f for f in set(a) | set(b) if a.get(f) != b.get(f))
                problems.append(f"{p.name}: the wheel built from the sdist differs from the tree's in {diff}")
            meta = _metadata(wheel)
            if meta["Version"] != p.version or meta["Name"] != p.name:
                problems.append(
                    f"{p.name}: METADATA says {meta['Name']} {meta['Version']}, pyproject {p.version}"
                )
            files = set(a)
            mod_dir = p.module.replace(".", "/")
            for must in (f"{mod_dir}/__init__.py", f"{mod_dir}/py.typed", f"{mod_dir}/_version.py"):
                if must not in files:
                    problems.append(f"{p.name}: {must} missing from {wheel.name}")
            if not any(f.endswith(".dist-info/licenses/LICENSE") for f in files):
                problems.append(f"{p.name}: no LICENSE in {wheel.name}")
            if "automodel/__init__.py" in files:
                problems.append(f"{p.name}: ships automodel/__init__.py (automodel is a PEP 420 namespace)")
            for req in meta.get_all("Requires-Dist") or []:
                name = _req_name(req)
                if name in versions:
                    spec = (
                        re.sub(r"^\s*\[[^\]]*\]", "", req[len(name) :]).split(";")[0].strip()
                    )  # no [extras]
                    if not spec or not _admits(spec, versions[name]):
                        problems.append(
                            f"{p.name}: requires {req!r}, but the workspace's {name} is {versions[name]}"
                        )
            print(f"  {wheel.name}: {len(files)} files, sdist rebuild identical: {a == b}", flush=True)
    _run(
        [
            sys.executable,
            "-m",
            "twine",
            "check",
            "--strict",
            *(str(f) for pair in built.values() for f in pair),
        ]
    )
    if problems:
        sys.exit("build check failed:\n  " + "\n  ".join(problems))
    print(f"built and checked {len(built)} wheels + sdists in {out} ({time.perf_counter() - t0:.1f} s)")
    return built


def harness_names(harness: Path = HARNESS) -> tuple[frozenset[str], frozenset[str]]:
    """(module names, public top-level function and class names) of the dev-only test harness,
    read from its source: what would show that the harness came back into a wheel."""
    modules, defs = set(), set()
    for path in harness.glob("*.py"):
        if path.stem != "__init__":
            modules.add(path.stem)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                defs.add(node.name)
    return frozenset(modules), frozenset(defs)


def wheel_test_code(wheel: Path, *, harness: Path = HARNESS) -> list[str]:
    """Why `wheel` holds test code (empty: it holds none): a module named like test code
    (``testing``, ``conftest``, ``test_*``) or like a harness module (``ranks``, ``tiny_model``, ...),
    a module importing pytest or automodel.testing, or a top-level function or class of the
    harness's (``run_on_ranks``, ``tiny_causal_lm``, ``check_layout_applied``, ...)."""
    modules, defs = harness_names(harness)
    found: list[str] = []
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(n for n in z.namelist() if n.endswith(".py")):
            stem = Path(name).stem
            if stem in TEST_MODULES or stem in modules or stem.startswith("test_"):
                found.append(f"{name}: a test module by its name")
            tree = ast.parse(z.read(name).decode(), filename=name)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    imported = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    imported = [node.module or ""]
                else:
                    continue
                for mod in imported:
                    if mod.split(".")[0] in ("pytest", "_pytest") or mod.startswith("automodel.testing"):
                        found.append(f"{name}:{node.lineno}: imports {mod}")
            for node in tree.body:
                if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in defs:
                    found.append(f"{name}:{node.lineno}: defines the harness's {node.name}")
    return found


def _closure(name: str, wheels: dict[str, Path]) -> list[str]:
    """`name` and the workspace siblings its wheel requires, transitively (extras not followed)."""
    seen, todo = [], [name]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.append(n)
        for req in _metadata(wheels[n]).get_all("Requires-Dist") or []:
            if "extra ==" not in req and _req_name(req) in wheels:
                todo.append(_req_name(req))
    return seen


def install_alone(out: Path, only: list[str] | None = None) -> None:
    uv = _uv()
    t_all = time.perf_counter()
    built = build(out)
    wheels = {name: w for name, (w, _) in built.items()}
    packages = {p.name: p for p in workspace_packages()}
    base = ROOT / ".nox" / "install_alone"
    if base.exists():
        shutil.rmtree(base)
    base.mkdir(parents=True)
    constraints = base / "constraints.txt"
    _run(
        [uv, "export", "--frozen", "--all-packages", "--no-emit-workspace", "--no-dev", "--no-hashes",
         "--no-header", "--no-annotate", "--format", "requirements-txt", "-o", str(constraints), "--quiet"]
    )  # fmt: skip
    env = _clean_env()
    timings = []
    for name in only or sorted(packages):
        p = packages[name]
        t0 = time.perf_counter()
        root = base / name
        venv, work = root / "venv", root / "work"
        work.mkdir(parents=True)  # uv runs in `root`: no workspace pyproject.toml / uv.toml is seen
        python = venv / "bin" / "python"
        _run(
            [uv, "venv", "--quiet", "--no-config", "--no-project", "--python", sys.executable, str(venv)],
            cwd=root,
            env=env,
        )
        needed = _closure(name, wheels)
        _run(
            [uv, "pip", "install", "--quiet", "--no-config", "--python", str(python), "-c", str(constraints),
             *(str(wheels[n]) for n in needed)],
            cwd=root,
            env=env,
        )  # fmt: skip
        t_install = time.perf_counter() - t0
        _run([uv, "pip", "check", "--no-config", "--python", str(python)], cwd=root, env=env)
        listed = json.loads(
            _run(
                [uv, "pip", "list", "--no-config", "--python", str(python), "--format", "json"],
                cwd=root,
                env=env,
            )
        )
        installed = {d["name"].lower(): d["version"] for d in listed}
        automodel = {n for n in installed if n.startswith("automodel-")}
        if automodel != set(needed):
            sys.exit(f"{name}: venv holds {sorted(automodel)}, expected exactly {sorted(needed)}")
        if "transformers" in installed and not any(
            _req_name(r) == "transformers" for r in p.dependencies
        ):  # fmt: skip
            sys.exit(f"{name}: transformers was installed though {name} does not require it")
        run_env = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}  # cache .pyc in the venv
        run_env["OMP_NUM_THREADS"] = "1"
        probe = (
            f"import {p.module} as m, pathlib, sys; "
            f"assert pathlib.Path(m.__file__).resolve().is_relative_to(pathlib.Path(sys.prefix).resolve()), m.__file__; "
            f"print(m.__version__)"
        )
        got = _run([str(python), "-I", "-c", probe], cwd=work, env=run_env).strip().splitlines()[-1]
        if got != p.version:
            sys.exit(f"{name}: {p.module}.__version__ is {got!r}, pyproject.toml says {p.version}")
        test_code = [f"{wheels[n].name}: {why}" for n in needed for why in wheel_test_code(wheels[n])]
        if test_code:
            sys.exit(f"{name}: the installed wheels hold test code:\n  " + "\n  ".join(test_code))
        if SMOKE_TOOLS.get(name):  # after the checks above: third-party tools the smoke script runs
            _run(
                [uv, "pip", "install", "--quiet", "--no-config", "--python", str(python), "-c", str(constraints),
                 *SMOKE_TOOLS[name]],
                cwd=root,
                env=env,
            )  # fmt: skip
        smoke = SMOKE / f"smoke_{p.module.split('.', 1)[1]}.py"
        arg = {
            "automodel-pipeline": [str(p.folder / "README.md")],
            "automodel-data": [str(p.folder / "README.md")],
            "automodel-recipes": [str(ROOT / "examples" / "quickstart.yaml")],
        }.get(name, [])
        result = _run([str(python), "-I", str(smoke), *arg], cwd=work, env=run_env)
        seconds = time.perf_counter() - t0
        timings.append((name, t_install, seconds))
        print(result.rstrip())
        print(
            f"{name}: installed alone with {len(installed)} distributions "
            f"({', '.join(sorted(automodel))}; torch {installed.get('torch')}) in {t_install:.1f} s; "
            f"import, no test code, smoke ok; {seconds:.1f} s",
            flush=True,
        )
    shutil.rmtree(base, ignore_errors=True)  # 8 venvs of hard links: cheap, but no reason to keep them
    print("install_alone timings (install / total):")
    for name, ti, tt in timings:
        print(f"  {name:34s} {ti:6.1f} s {tt:7.1f} s")
    print(
        f"install_alone: {len(timings)} packages ok in {time.perf_counter() - t_all:.1f} s (build included)"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["build", "install-alone"])
    ap.add_argument("--out", type=Path, default=ROOT / "dist")
    ap.add_argument("--only", nargs="*", default=None, help="install-alone: these distributions only")
    args = ap.parse_args(argv)
    if args.command == "build":
        build(args.out)
    else:
        install_alone(args.out, args.only)


if __name__ == "__main__":
    main()
