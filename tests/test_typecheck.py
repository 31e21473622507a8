"""`nox -s typecheck` (basedpyright, pyproject.toml's settings) fails on the stale import a GPU run
once hit (`apply_tp` moved from automodel.megatron_fsdp to automodel.fsdp2) and on a wrong call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check(tmp_path: Path, source: str) -> tuple[int, list[str]]:
    path = tmp_path / "snippet.py"
    path.write_text(source)
    proc = subprocess.run(
        [sys.executable, "-m", "basedpyright", "--pythonpath", sys.executable, "--outputjson", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    return proc.returncode, [d["message"] for d in json.loads(proc.stdout)["generalDiagnostics"]]


def test_stale_import_fails_the_check(tmp_path: Path) -> None:
    code, messages = _check(tmp_path, "from automodel.megatron_fsdp import apply_tp\n\nprint(apply_tp)\n")
    assert code == 1 and any('"apply_tp" is unknown import symbol' in m for m in messages), messages


def test_wrong_call_fails_and_the_right_import_passes(tmp_path: Path) -> None:
    code, messages = _check(tmp_path, "from automodel.fsdp2 import apply_tp\n\napply_tp(None, mesh=None)\n")
    assert code == 1 and any('No parameter named "mesh"' in m for m in messages), messages
    assert _check(tmp_path, "from automodel.fsdp2 import apply_tp\n\nprint(apply_tp)\n") == (0, [])
