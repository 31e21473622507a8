"""scripts/release_check.py on a throw-away git repository with two packages and release tags."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("release_check", ROOT / "scripts" / "release_check.py")
release_check = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("release_check", release_check)  # dataclasses look their module up there
_spec.loader.exec_module(release_check)

GIT_ENV = {
    **os.environ,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, env=GIT_ENV, check=True, capture_output=True)


def _heading(entry: str) -> str:
    """'0.1.0 - unreleased' -> '## [0.1.0] - unreleased'."""
    version, _, rest = entry.partition(" ")
    return f"## [{version}] {rest}".rstrip()


def write_package(
    repo: Path,
    folder: str,
    version: str,
    *,
    deps: tuple[str, ...] = (),
    entries: tuple[str, ...] | None = None,
) -> Path:
    pkg = repo / "packages" / folder
    (pkg / "src" / "automodel" / folder).mkdir(parents=True, exist_ok=True)
    (pkg / "tests").mkdir(exist_ok=True)
    deps_toml = ", ".join(f'"{d}"' for d in deps)
    (pkg / "pyproject.toml").write_text(
        f'[project]\nname = "automodel-{folder}"\nversion = "{version}"\ndependencies = [{deps_toml}]\n'
    )
    headings = entries if entries is not None else (f"{version} - unreleased",)
    (pkg / "CHANGELOG.md").write_text(
        "# Changelog\n\n" + "".join(f"{_heading(h)}\n\n- x\n\n" for h in headings)
    )
    init = pkg / "src" / "automodel" / folder / "__init__.py"
    if not init.exists():
        init.write_text("X = 1\n")
    return pkg


def set_version(pkg: Path, old: str, new: str) -> None:
    text = (pkg / "pyproject.toml").read_text()
    (pkg / "pyproject.toml").write_text(text.replace(f'version = "{old}"', f'version = "{new}"'))


def add_entry(pkg: Path, heading: str) -> None:
    text = (pkg / "CHANGELOG.md").read_text()
    (pkg / "CHANGELOG.md").write_text(
        text.replace("# Changelog\n\n", f"# Changelog\n\n{_heading(heading)}\n\n- y\n\n")
    )


def date_entry(pkg: Path, version: str) -> None:
    text = (pkg / "CHANGELOG.md").read_text()
    (pkg / "CHANGELOG.md").write_text(
        text.replace(f"## [{version}] - unreleased", f"## [{version}] - 2026-01-02")
    )


def commit(repo: Path, message: str = "c") -> None:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)


def problems(repo: Path) -> list[str]:
    return release_check.check(repo)[0]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q", "-b", "main")
    write_package(tmp_path, "mesh", "0.1.0")
    write_package(tmp_path, "pipeline", "0.1.0", deps=("automodel-mesh>=0.1.0,<0.2", "torch>=2.11"))
    commit(tmp_path)
    return tmp_path


def release(repo: Path, folder: str, version: str) -> None:
    date_entry(repo / "packages" / folder, version)
    commit(repo, f"release {folder} {version}")
    git(repo, "tag", release_check.tag_name(f"automodel-{folder}", version))


def test_no_tag_needs_only_an_entry_for_the_current_version(repo: Path) -> None:
    assert problems(repo) == []
    _, status = release_check.check(repo)
    assert "automodel-mesh 0.1.0: no release tag yet (automodel-mesh-v0.1.0 when released)" in status
    write_package(repo, "mesh", "0.1.0", entries=("0.0.9 - unreleased",))
    assert problems(repo) == [
        "automodel-mesh: packages/mesh/CHANGELOG.md has no `## [0.1.0]` entry for the current version"
    ]
    (repo / "packages" / "mesh" / "CHANGELOG.md").unlink()
    assert problems(repo) == ["automodel-mesh: packages/mesh/CHANGELOG.md is missing"]


def test_entry_newer_than_the_version_is_an_error(repo: Path) -> None:
    add_entry(repo / "packages" / "mesh", "0.2.0 - unreleased")
    assert problems(repo) == [
        "automodel-mesh: CHANGELOG.md has entries ['0.2.0'] newer than pyproject's version 0.1.0"
    ]


def test_tagged_and_unchanged_passes_changed_code_needs_bump_and_entry(repo: Path) -> None:
    release(repo, "mesh", "0.1.0")
    release(repo, "pipeline", "0.1.0")
    assert problems(repo) == []
    _, status = release_check.check(repo)
    assert "automodel-mesh 0.1.0: released as automodel-mesh-v0.1.0, unchanged since" in status

    mesh = repo / "packages" / "mesh"
    (mesh / "tests" / "test_x.py").write_text("def test(): pass\n")  # tests are not shipped
    (mesh / "CHANGELOG.md").write_text((mesh / "CHANGELOG.md").read_text() + "\n")
    commit(repo)
    assert problems(repo) == []

    (mesh / "src" / "automodel" / "mesh" / "__init__.py").write_text("X = 2\n")  # uncommitted counts
    [p] = problems(repo)
    assert p.startswith(
        "automodel-mesh: changed since automodel-mesh-v0.1.0 (packages/mesh/src/automodel/mesh/__init__.py)"
    )
    assert "without a version bump" in p
    commit(repo)
    assert len(problems(repo)) == 1

    set_version(mesh, "0.1.0", "0.1.1")  # bump without an entry
    assert problems(repo) == [
        "automodel-mesh: packages/mesh/CHANGELOG.md has no `## [0.1.1]` entry for the current version"
    ]
    add_entry(mesh, "0.1.1 - unreleased")
    assert problems(repo) == []
    _, status = release_check.check(repo)
    assert "automodel-mesh 0.1.1: bumped since automodel-mesh-v0.1.0, to be released" in status
    commit(repo)
    release(repo, "mesh", "0.1.1")
    assert problems(repo) == []


def test_untracked_file_in_src_readme_and_pyproject_count(repo: Path) -> None:
    release(repo, "mesh", "0.1.0")
    mesh = repo / "packages" / "mesh"
    (mesh / "src" / "automodel" / "mesh" / "new.py").write_text("Y = 1\n")
    assert "packages/mesh/src/automodel/mesh/new.py" in problems(repo)[0]
    (mesh / "src" / "automodel" / "mesh" / "new.py").unlink()
    (mesh / "README.md").write_text("# mesh\n")
    assert "packages/mesh/README.md" in problems(repo)[0]


def test_version_older_than_last_tag_and_undated_release(repo: Path) -> None:
    release(repo, "mesh", "0.1.0")
    mesh = repo / "packages" / "mesh"
    set_version(mesh, "0.1.0", "0.0.9")
    add_entry(mesh, "0.0.9 - unreleased")
    assert (
        "automodel-mesh: version 0.0.9 is older than the last release tag automodel-mesh-v0.1.0"
        in problems(repo)
    )

    set_version(mesh, "0.0.9", "0.1.0")
    write_package(repo, "mesh", "0.1.0")  # heading back to "- unreleased" although tagged
    [p] = problems(repo)
    assert "automodel-mesh-v0.1.0 is tagged but its CHANGELOG.md heading is `## [0.1.0] - unreleased`" in p


def test_newest_tag_wins_and_odd_tags_are_ignored(repo: Path) -> None:
    release(repo, "mesh", "0.1.0")
    git(repo, "tag", "automodel-mesh-vnext")  # not a version: ignored
    git(repo, "tag", "automodel-mesh-v0.0.1")
    assert [t for _, t in release_check.release_tags(repo, "automodel-mesh")] == [
        "automodel-mesh-v0.0.1",
        "automodel-mesh-v0.1.0",
    ]
    assert problems(repo) == []


def test_sibling_bounds_must_admit_the_current_sibling(repo: Path) -> None:
    mesh = repo / "packages" / "mesh"
    set_version(mesh, "0.1.0", "0.2.0")
    add_entry(mesh, "0.2.0 - unreleased")
    assert problems(repo) == [
        "automodel-pipeline: requires 'automodel-mesh>=0.1.0,<0.2', but the workspace's automodel-mesh is 0.2.0"
    ]


def test_this_repository_passes() -> None:
    """The real packages: every one has a changelog entry for its version and admissible bounds."""
    assert release_check.check(ROOT)[0] == []
