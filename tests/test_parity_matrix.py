"""The parity matrix as tests: each layout's config, trained by the recipes on forked ranks, reproduces
the single-process losses, and every rank holds what the layout says (`automodel.testing.layout_check`). The
same configs through the real CLI (torchrun): `python tests/parity_matrix.py` (docs/parity.md)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from parity_matrix import (  # noqa: E402
    MATRIX_LAYOUTS,
    REFERENCES,
    RTOL,
    STEPS,
    Layout,
    check_reports,
    max_relative_difference,
    read_grad_norms,
    read_reports,
    run_layout,
)


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("parity_ref")


@pytest.fixture(scope="module")
def references(reference_dir: Path) -> dict[str, list[float]]:
    refs = {kind: run_layout(layout, reference_dir, launcher="forked") for kind, layout in REFERENCES.items()}
    for kind, losses in refs.items():
        assert len(losses) == STEPS, (kind, losses)
        assert losses[-1] < losses[0], f"{kind} reference does not learn: {losses}"
    return refs


@pytest.mark.parametrize("layout", MATRIX_LAYOUTS, ids=[layout.name for layout in MATRIX_LAYOUTS])
def test_placement_checks_reject_a_run_with_the_parallelism_off(
    layout: Layout, references: dict[str, list[float]], reference_dir: Path
) -> None:
    """The single-process run reproduces every layout's losses trivially; its report, standing in
    for each rank of the layout, must fail that layout's placement checks."""
    (single,) = read_reports(REFERENCES[layout.model], reference_dir)
    stand_ins = [{**copy.deepcopy(single), "rank": rank} for rank in range(layout.ranks)]
    with pytest.raises(AssertionError):
        check_reports(layout, stand_ins)


@pytest.mark.parametrize("layout", MATRIX_LAYOUTS, ids=[layout.name for layout in MATRIX_LAYOUTS])
def test_layout_reproduces_single_process_losses(
    layout: Layout, references: dict[str, list[float]], reference_dir: Path, tmp_path: Path
) -> None:
    """Losses and gradient norms of the layout (chunked linear CE) equal the single process's
    (full-logits CE) to RTOL at every step."""
    losses = run_layout(layout, tmp_path, launcher="forked")
    ref = references[layout.model]
    diff = max_relative_difference(losses, ref)
    assert diff <= RTOL, f"{layout.name}: losses {losses} vs single process {ref} (max rel diff {diff:.2e})"
    # the gradients too (Adam hides their scale from the losses): the norm before clipping
    norms, ref_norms = (
        read_grad_norms(layout, tmp_path),
        read_grad_norms(REFERENCES[layout.model], reference_dir),
    )
    norm_diff = max_relative_difference(norms, ref_norms)
    assert norm_diff <= RTOL, (
        f"{layout.name}: grad norms {norms} vs single process {ref_norms} ({norm_diff:.2e})"
    )
    check_reports(layout, read_reports(layout, tmp_path))
