"""docs/models.md as data: render the conformance outcomes as the matrix and read them back.

Reading the published matrix back lets a later run re-test a few cells (``matrix.py --update``)
and rewrite the page with every other cell kept, so the page stays generated, never hand-edited.
Each run that wrote the page is listed under "Runs" with its command and what it re-tested.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("fsdp2", "tp2", "tp2_sp", "pp2", "cp2", "ep2")
_NOTE = re.compile(r"^(\d+)\. `([^`]+)`(?: (\S+) (\S+): \*\*(\S+)\*\* — |: )(.*)$")
_CELL = re.compile(r"^(pass|refused|FAIL) \[(\d+)\]$")


@dataclass
class Outcome:
    model_type: str
    variant: str
    layout: str
    status: str  # pass | refused | FAIL | n/a
    detail: str = ""
    max_rel: float | None = None


def header(*, steps: int, lr: float, rtol: float, noise_factor: int) -> list[str]:
    """What the page measures and how to read it (the same for every run)."""
    return [
        "# Model conformance matrix",
        "",
        "Every model_type in transformers' `AutoModelForCausalLM` registry, as a tiny config (the config class's",
        "own defaults with sizes shrunk: 4 layers, hidden 64, vocab 256, 4 experts top-2), trained for",
        f"{steps} SGD steps (lr {lr}) in fp32 through the recipes' code path (pre-launch checks, then `run_training`",
        "on gloo ranks): once in one process, then under each layout. **pass**: every step's loss and gradient",
        f"norm within {rtol:g} relative of one process, and every rank holds what the layout asks for (FSDP",
        "dim-0 shards, TP shards in every layer, SP norms on the tp mesh, disjoint pipeline stages, the CP",
        "ring backend, experts split over ep); a model whose own training amplifies rounding (one process",
        "with eager instead of sdpa attention, both exact, differs by more than that) may differ at each step",
        f"by up to {noise_factor}x the noise measured up to that step, shown as **pass [n]** with the numbers.",
        "**refused**: stopped before launch with the message shown.",
        "**FAIL**: anything else. *n/a*: the registry entry cannot be built as a tiny decoder (shown why).",
        "",
        "Variants: `options` switches on every math-changing option the config has (multipliers, logit",
        "scaling and soft-capping, a sliding window of 8 < sequence 32, biases, qk-norm); `tie_flipped`",
        "flips `tie_word_embeddings`. They run under tp2 and pp2 (a sweep without `--no-variants`).",
        "",
        "Written by `uv run --frozen nox -s conformance` (= `python tests/conformance/matrix.py`, the whole",
        "registry); `matrix.py --update --models ... --layouts ...` re-tests some cells and keeps the rest.",
    ]


def render(outcomes: list[Outcome], *, head: list[str], runs: list[str]) -> str:
    """The page: header, the runs that wrote it, pass counts, the matrix and its numbered notes."""
    rows: dict[tuple[str, str], dict[str, Outcome]] = {}
    for o in outcomes:
        rows.setdefault((o.model_type, o.variant), {})[o.layout] = o
    defaults = [r for (_, v), r in rows.items() if v == "default"]
    passing = {c: sum(1 for r in defaults if r.get(c) and r[c].status == "pass") for c in COLUMNS}
    variant_rows = [r for (_, v), r in rows.items() if v != "default"]
    variant_cells = [o for r in variant_rows for o in r.values()]
    lines = [*head, "", "## Runs", "", *[f"- {run}" for run in runs], ""]
    lines.append("Passing (default configs): " + ", ".join(f"{c} {passing[c]}" for c in COLUMNS))
    if variant_cells:
        lines.append(
            f"Variants: {sum(o.status == 'pass' for o in variant_cells)} pass, "
            f"{sum(o.status == 'refused' for o in variant_cells)} refused, "
            f"{sum(o.status == 'FAIL' for o in variant_cells)} FAIL of {len(variant_cells)} cells"
        )
    lines += [
        "",
        "| model_type | variant | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    notes: list[str] = []
    for (model_type, variant), by_layout in sorted(rows.items()):
        if "*" in by_layout:
            cells = ["n/a"] * len(COLUMNS)
            notes.append(f"`{model_type}`: {by_layout['*'].detail}")
        else:
            cells = [cell(by_layout.get(c), notes, label=f"`{model_type}` {variant} {c}") for c in COLUMNS]
        lines.append(f"| {model_type} | {variant} | " + " | ".join(cells) + " |")
    lines += ["", "## Notes", "", *[f"{i}. {n}" for i, n in enumerate(notes, 1)], ""]
    return "\n".join(lines)


def cell(outcome: Outcome | None, notes: list[str], *, label: str) -> str:
    """One table cell: empty, ``pass``, or the status and the number of its note (added to `notes`)."""
    if outcome is None:
        return ""
    if outcome.status == "pass" and not outcome.detail:
        return "pass"
    notes.append(f"{label}: **{outcome.status}** — {outcome.detail}")
    return f"{outcome.status} [{len(notes)}]"


def read(path: Path) -> tuple[list[Outcome], list[str]]:
    """The outcomes and the run list of a page `render` wrote (a pass's max_rel is not kept)."""
    text = path.read_text()
    notes: dict[int, tuple[str, str]] = {}
    for line in text.splitlines():
        m = _NOTE.match(line)
        if m:
            notes[int(m[1])] = (m[5] or "n/a", m[6])
    outcomes: list[Outcome] = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith("| model_type") or line.startswith("|---"):
            continue
        model_type, variant, *cells = (c.strip() for c in line.strip("|").split("|"))
        if cells and all(c == "n/a" for c in cells):
            outcomes.append(Outcome(model_type, variant, "*", "n/a", _na_detail(text, model_type)))
            continue
        for column, cell in zip(COLUMNS, cells, strict=True):
            if cell == "pass":
                outcomes.append(Outcome(model_type, variant, column, "pass"))
            elif m := _CELL.match(cell):
                status, detail = notes[int(m[2])]
                outcomes.append(Outcome(model_type, variant, column, status, detail))
            elif cell:
                raise ValueError(f"{path}: cannot read cell {cell!r} of {model_type}/{variant}/{column}")
    runs, in_runs = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            in_runs = line == "## Runs"
        elif in_runs and line.startswith("- "):
            runs.append(line[2:])
    return outcomes, runs


def _na_detail(text: str, model_type: str) -> str:
    m = re.search(rf"^\d+\. `{re.escape(model_type)}`: (.*)$", text, flags=re.M)
    return m[1] if m else ""


def merge(old: list[Outcome], new: list[Outcome], *, whole: bool = False) -> list[Outcome]:
    """`old` with every cell `new` re-tested replaced (a model's n/a row goes if it was re-run).

    `whole`: the models in `new` were re-run on every layout and variant, so none of their old
    cells stays (a variant the config no longer accepts, a layout that no longer applies)."""
    retested = {(o.model_type, o.variant, o.layout) for o in new}
    rerun_models = {o.model_type for o in new}
    kept = [
        o
        for o in old
        if (o.model_type, o.variant, o.layout) not in retested
        and not (whole and o.model_type in rerun_models)
        and not (o.layout == "*" and o.model_type in rerun_models)
        and not (any(n.layout == "*" and n.model_type == o.model_type for n in new))
    ]
    return kept + new
