"""The parity matrix as tests: each layout through `recipes train` reproduces the single-process
losses, and every rank holds what the layout says (`placement_checks`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parity_matrix import (  # noqa: E402
    LAYOUTS,
    REFERENCES,
    RTOL,
    STEPS,
    Layout,
    check_reports,
    max_relative_difference,
    read_reports,
    run_layout,
)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    work = tmp_path_factory.mktemp("parity_ref")
    refs = {kind: run_layout(layout, work) for kind, layout in REFERENCES.items()}
    for kind, losses in refs.items():
        assert len(losses) == STEPS, (kind, losses)
        assert losses[-1] < losses[0], f"{kind} reference does not learn: {losses}"
    return refs


@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
def test_layout_reproduces_single_process_losses(
    layout: Layout, references: dict[str, list[float]], tmp_path: Path
) -> None:
    losses = run_layout(layout, tmp_path)
    ref = references[layout.model]
    diff = max_relative_difference(losses, ref)
    assert diff <= RTOL, f"{layout.name}: losses {losses} vs single process {ref} (max rel diff {diff:.2e})"
    check_reports(layout, read_reports(layout, tmp_path))
