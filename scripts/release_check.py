"""`nox -s release_check`: every package's version, changelog and release tag agree.

Tag scheme: `<distribution>-v<version>`, e.g. `automodel-pipeline-v0.1.0` (one tag per package
release, on the commit the distribution was built from; see RELEASING.md).

For each package under packages/ (its version from pyproject.toml; a package classified
`Private :: Do Not Upload`, the dev-only packages/testing, is never released and is skipped):

- its CHANGELOG.md has an entry `## [<version>]` for the current version, and no entry for a
  newer one (an `## [Unreleased]` section is allowed on top);
- once the current version is tagged, its entry carries the release date (`## [0.1.0] - 2025-01-31`;
  `- unreleased` until then);
- with no release tag yet, that is all (the first release is whatever is current);
- with tags, the current version is not older than the newest tagged one; if it *is* the newest
  tagged one, nothing that goes into the distribution (`src/`, `pyproject.toml`, `README.md`,
  `LICENSE` of the package; tests and the changelog do not count) differs between that tag and the
  working tree, untracked files included: changed code needs a version bump and a changelog entry;
- every requirement on a sibling (`automodel-mesh>=0.1.0,<0.2`) admits the sibling's current version.

Exit status 1 with one line per problem, else 0 with one line per package.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

RELEASE_PATHS = ("src", "pyproject.toml", "README.md", "LICENSE")
_HEADING = re.compile(r"^## \[([^\]]+)\](.*)$", re.M)
_DATE = re.compile(r"^\s*-\s*\d{4}-\d{2}-\d{2}\s*$")


@dataclass(frozen=True)
class Package:
    name: str
    folder: Path  # relative to the repository root
    version: str
    dependencies: tuple[str, ...]


def tag_name(package: str, version: str) -> str:
    return f"{package}-v{version}"


def read_packages(root: Path) -> list[Package]:
    out = []
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text())["project"]
        if "Private :: Do Not Upload" in project.get("classifiers", []):
            continue  # never released (packages/testing, the dev-only test harness)
        out.append(
            Package(
                name=project["name"],
                folder=pyproject.parent.relative_to(root),
                version=str(project["version"]),
                dependencies=tuple(project.get("dependencies", [])),
            )
        )
    return out


def changelog_entries(text: str) -> dict[str, str]:
    """{version: what follows its heading} (`## [0.1.0] - 2025-01-31` -> {"0.1.0": " - 2025-01-31"}),
    in file order; an `## [Unreleased]` section is left out."""
    return {v.strip(): rest for v, rest in _HEADING.findall(text) if v.strip().lower() != "unreleased"}


def changelog_versions(text: str) -> list[str]:
    return list(changelog_entries(text))


def _git(root: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc.stdout


def release_tags(root: Path, package: str) -> list[tuple[Version, str]]:
    """This package's release tags, oldest first (tags whose suffix is not a version are ignored)."""
    out = []
    for tag in _git(root, "tag", "--list", f"{package}-v*").split():
        try:
            out.append((Version(tag[len(package) + 2 :]), tag))
        except InvalidVersion:
            continue
    return sorted(out)


def changed_since(root: Path, tag: str, folder: Path) -> list[str]:
    """Files of the distribution that differ between `tag` and the working tree (untracked too)."""
    paths = [str(folder / p) for p in RELEASE_PATHS]
    changed = _git(root, "diff", "--name-only", tag, "--", *paths).split()
    untracked = _git(root, "ls-files", "--others", "--exclude-standard", "--", *paths).split()
    return sorted(set(changed) | set(untracked))


def check(root: Path) -> tuple[list[str], list[str]]:
    """(problems, one status line per package)."""
    packages = read_packages(root)
    versions = {p.name: p.version for p in packages}
    problems, status = [], []
    for p in packages:
        try:
            current = Version(p.version)
        except InvalidVersion:
            problems.append(
                f"{p.name}: version {p.version!r} in {p.folder}/pyproject.toml is not a valid version"
            )
            continue
        changelog = root / p.folder / "CHANGELOG.md"
        entries = changelog_entries(changelog.read_text()) if changelog.is_file() else {}
        if not changelog.is_file():
            problems.append(f"{p.name}: {p.folder}/CHANGELOG.md is missing")
        elif p.version not in entries:
            problems.append(
                f"{p.name}: {p.folder}/CHANGELOG.md has no `## [{p.version}]` entry for the current version"
            )
        newer = [v for v in entries if _newer(v, current)]
        if newer:
            problems.append(
                f"{p.name}: CHANGELOG.md has entries {newer} newer than pyproject's version {p.version}"
            )
        for req in p.dependencies:
            r = Requirement(req)
            if r.name in versions and not r.specifier.contains(versions[r.name], prereleases=True):
                problems.append(
                    f"{p.name}: requires {req!r}, but the workspace's {r.name} is {versions[r.name]}"
                )
        tags = release_tags(root, p.name)
        if not tags:
            status.append(
                f"{p.name} {p.version}: no release tag yet ({tag_name(p.name, p.version)} when released)"
            )
            continue
        last, last_tag = tags[-1]
        if current < last:
            problems.append(f"{p.name}: version {p.version} is older than the last release tag {last_tag}")
        elif current == last:
            changed = changed_since(root, last_tag, p.folder)
            if changed:
                shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
                problems.append(
                    f"{p.name}: changed since {last_tag} ({shown}) without a version bump: raise `version` in "
                    f"{p.folder}/pyproject.toml and add a `## [<new version>]` entry to {p.folder}/CHANGELOG.md"
                )
            else:
                status.append(f"{p.name} {p.version}: released as {last_tag}, unchanged since")
            if p.version in entries and not _DATE.match(entries[p.version]):
                problems.append(
                    f"{p.name}: {last_tag} is tagged but its CHANGELOG.md heading is `## [{p.version}]"
                    f"{entries[p.version]}`: give it the release date (`## [{p.version}] - YYYY-MM-DD`)"
                )
        else:
            status.append(f"{p.name} {p.version}: bumped since {last_tag}, to be released")
    return problems, status


def _newer(entry: str, current: Version) -> bool:
    try:
        return Version(entry) > current
    except InvalidVersion:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="check versions, changelogs and release tags of the packages")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = ap.parse_args(argv)
    problems, status = check(args.root)
    for line in status:
        print(f"ok {line}")
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
