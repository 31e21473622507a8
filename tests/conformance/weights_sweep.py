"""HF weights in and out over the registry: writes docs/weights.md.

For each model_type, on every layout where docs/models.md says its default tiny config passes,
`weights_check.WeightsCase` saves the tiny model with ``save_pretrained``, trains two fp32 steps
from it through the recipes (one process, then the layout), checks the first loss against
transformers' own (weights in), and the ``from_pretrained`` reload of the step-1 consolidated
checkpoint against the recipes' step-2 loss and the one-process reload's logits, and each tensor's
step-1 update against one process's (weights out), all at relative 1e-5 (updates: 1e-4).

    uv run --frozen python tests/conformance/weights_sweep.py                      # all, docs/weights.md
    uv run --frozen python tests/conformance/weights_sweep.py --models llama,gpt2 --layouts pp2
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from matrix import Refused, _short, prioritized  # noqa: E402
from matrix_doc import COLUMNS, Outcome, cell, read  # noqa: E402
from weights_check import RTOL, STEPS, UPDATE_RTOL, WeightsCase  # noqa: E402


def passing_layouts(models_md: Path) -> dict[str, list[str]]:
    """model_type -> the layouts (in column order) where its default config passes in `models_md`."""
    outcomes, _ = read(models_md)
    out: dict[str, list[str]] = {}
    for o in outcomes:
        if o.variant == "default" and o.status == "pass":
            out.setdefault(o.model_type, []).append(o.layout)
    return {m: [c for c in COLUMNS if c in ls] for m, ls in out.items()}


def run_model(model_type: str, layouts: list[str], workdir: Path) -> list[Outcome]:
    """The weights check of `model_type` on each of `layouts`."""
    try:
        case = WeightsCase(model_type, workdir)
    except Exception as err:  # the reference (save, one process, reload) already fails
        reason = f"one process: {_short(err)}"
        return [Outcome(model_type, "default", x, "FAIL", reason) for x in layouts]
    outcomes = []
    for layout in layouts:
        try:
            case.check(layout)
            outcomes.append(Outcome(model_type, "default", layout, "pass"))
        except Refused as err:
            outcomes.append(Outcome(model_type, "default", layout, "refused", str(err)[:300]))
        except Exception as err:
            outcomes.append(Outcome(model_type, "default", layout, "FAIL", _short(err)))
    return outcomes


#: Kinds of failure, told apart by their message: (label, substring).
_KINDS = (
    ("the recipes' loader finds no tensor under a parameter's name", "weights this model needs"),
    ("weights in: first loss differs from transformers'", "weights in:"),
    ("weights out: step-2 loss of the reload differs", "weights out: second loss"),
    ("weights out: reloaded logits differ from one process", "reloaded logits differ"),
    ("weights out: from_pretrained reports bad keys", "from_pretrained of the consolidated"),
)


def _kinds(outcomes: list[Outcome]) -> list[str]:
    """One line per kind of failure: how many models, which."""
    failed: dict[str, list[str]] = {}
    for o in outcomes:
        if o.status == "pass":
            continue
        label = next((lab for lab, sub in _KINDS if sub in o.detail), "other")
        if o.model_type not in failed.setdefault(label, []):
            failed[label].append(o.model_type)
    return [f"- {label}: {len(ms)} models ({', '.join(ms)})" for label, ms in failed.items()]


def render(outcomes: list[Outcome], *, runs: list[str], models_total: int, findings: str = "") -> str:
    rows: dict[str, dict[str, Outcome]] = {}
    for o in outcomes:
        rows.setdefault(o.model_type, {})[o.layout] = o
    counts = []
    for c in COLUMNS:
        cells = [r[c] for r in rows.values() if c in r]
        if cells:
            fails = sum(o.status != "pass" for o in cells)
            counts.append(
                f"{c} {sum(o.status == 'pass' for o in cells)}/{len(cells)}"
                + (f" ({fails} not pass)" if fails else "")
            )
    lines = [
        "# HF weights in and out",
        "",
        "A tiny model of each model_type (the conformance matrix's tiny config, docs/models.md) saved with",
        "transformers' `save_pretrained`, loaded by the recipes (`model.pretrained_path`) into one process",
        f"and into each layout where docs/models.md says the model passes, trained {STEPS} fp32 SGD steps through",
        "the recipes' code path with a consolidated checkpoint after step 1. **pass**: weights in, the first",
        f"step's loss equals transformers' own loss of the saved model on the same batch (relative {RTOL:g});",
        "weights out, the step-1 consolidated checkpoint loads back with `from_pretrained` with no missing,",
        "unexpected or mis-shaped keys, transformers' loss of the reload on the second batch equals the",
        f"recipes' step-2 loss ({RTOL:g}), every tensor's step-1 update in the layout's checkpoint equals",
        f"one process's (to {UPDATE_RTOL:g} of its largest update; runs from 2026-11-24 on), and the layout's",
        f"reload gives the one-process reload's logits ({RTOL:g}). **FAIL**: anything else (reason in the",
        "notes). An empty cell: the layout does not pass in",
        "docs/models.md (or was not selected), so is not run here.",
        "The check is `tests/conformance/weights_check.py` (also `test_weights_in_out.py` in the CPU suite).",
        "",
        "## Runs",
        "",
        *[f"- {run}" for run in runs],
        "",
        f"Models: {len(rows)} of {models_total} selected. Passing per layout: " + ", ".join(counts),
        "",
        "| model_type | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    notes: list[str] = []
    for model_type in prioritized(sorted(rows)):
        cells = [cell(rows[model_type].get(c), notes, label=f"`{model_type}` {c}") for c in COLUMNS]
        lines.append(f"| {model_type} | " + " | ".join(cells) + " |")
    kinds = _kinds(outcomes)
    if kinds:
        lines += ["", "## Failures by kind", "", *kinds]
    if findings:
        lines += ["", "## Findings", "", findings.strip()]
    lines += ["", "## Notes", "", *[f"{i}. {n}" for i, n in enumerate(notes, 1)], ""]
    return "\n".join(lines)


_PAGE_NOTE = re.compile(r"^(\d+)\. `([^`]+)` (\S+): \*\*(\S+)\*\* — (.*)$")


def read_page(path: Path) -> tuple[list[Outcome], list[str], str]:
    """(outcomes, run lines, findings) of a page `render` wrote, so a later run re-tests a few cells
    and keeps the rest (``--keep docs/weights.md``), as matrix.py does with docs/models.md."""
    text = path.read_text()
    notes = {int(m[1]): (m[4], m[5]) for line in text.splitlines() if (m := _PAGE_NOTE.match(line))}
    sections: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:]
        sections.setdefault(current, []).append(line)
    outcomes = []
    for line in text.splitlines():
        if not line.startswith("| ") or line.startswith(("| model_type", "|---")):
            continue
        model_type, *cells = (c.strip() for c in line.strip("|").split("|"))
        for column, text_cell in zip(COLUMNS, cells, strict=True):
            if text_cell == "pass":
                outcomes.append(Outcome(model_type, "default", column, "pass"))
            elif m := re.match(r"^(\S+) \[(\d+)\]$", text_cell):
                status, detail = notes[int(m[2])]
                outcomes.append(Outcome(model_type, "default", column, status, detail))
    runs = [line[2:] for line in sections.get("Runs", []) if line.startswith("- ")]
    findings = "\n".join(sections.get("Findings", [])[1:]).strip()
    return outcomes, runs, findings


def _load(path: Path) -> tuple[list[Outcome], list[str]]:
    """(outcomes, run lines) of a sweep's --json (an older plain list of outcomes has no runs)."""
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return [Outcome(**o) for o in data], []
    return [Outcome(**o) for o in data["outcomes"]], data["runs"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", help="comma-separated model_types (default: every model passing a layout)"
    )
    parser.add_argument("--layouts", help="comma-separated layouts (default: every passing one)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "weights.md"))
    parser.add_argument("--models-md", default=str(ROOT / "docs" / "models.md"))
    parser.add_argument("--json", default=None, help="also write the outcomes as JSON here")
    parser.add_argument(
        "--resume", default=None, help="JSON of an earlier sweep: keep its models, run the rest"
    )
    parser.add_argument(
        "--keep",
        default=None,
        help="an earlier sweep's JSON or published page (docs/weights.md): keep its cells and runs, "
        "re-test only the given models/layouts",
    )
    parser.add_argument(
        "--findings", default=None, help="markdown file: causes found, shown under Findings (kept by --keep)"
    )
    args = parser.parse_args(argv)
    import logging
    import warnings

    import torch
    import transformers

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    transformers.utils.logging.disable_progress_bar()
    passing = passing_layouts(Path(args.models_md))
    models = args.models.split(",") if args.models else prioritized(sorted(passing))
    wanted = set(args.layouts.split(",")) if args.layouts else set(COLUMNS)
    outcomes: list[Outcome] = []
    kept: list[Outcome] = []
    runs: list[str] = []
    if args.resume:
        outcomes, _ = _load(Path(args.resume))
        done = {o.model_type for o in outcomes}
        models = [m for m in models if m not in done]
    findings = ""
    if args.keep and args.keep.endswith(".md"):
        kept, runs, findings = read_page(Path(args.keep))
    elif args.keep:
        kept, runs = _load(Path(args.keep))
        data = json.loads(Path(args.keep).read_text())
        findings = data.get("findings", "") if isinstance(data, dict) else ""
    if args.findings:
        findings = Path(args.findings).read_text()
    command = " ".join(["tests/conformance/weights_sweep.py", *(argv if argv is not None else sys.argv[1:])])
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, model_type in enumerate(models, 1):
            layouts = [x for x in passing.get(model_type, []) if x in wanted]
            if not layouts:
                print(f"[{i}/{len(models)}] {model_type}: no passing layout selected", flush=True)
                continue
            t0 = time.time()
            try:
                got = run_model(model_type, layouts, Path(tmp) / model_type)
            except Exception:
                got = [
                    Outcome(model_type, "default", x, "FAIL", traceback.format_exc(limit=2)[-300:])
                    for x in layouts
                ]
            outcomes += got
            summary = ", ".join(f"{o.layout}={o.status}" for o in got)
            print(f"[{i}/{len(models)}] {model_type} ({time.time() - t0:.0f}s): {summary}", flush=True)
            for o in got:
                if o.status != "pass":
                    print(f"    {o.layout}: {o.detail}", flush=True)
            run = (
                f"{datetime.date.today()}: `{command}`, transformers {transformers.__version__}, "
                f"torch {torch.__version__}, CPU, {(time.time() - start) / 60:.0f} min"
                + (f" (resumed from `{args.resume}`)" if args.resume else "")
            )
            tested = {(o.model_type, o.layout) for o in outcomes}
            cells = [o for o in kept if (o.model_type, o.layout) not in tested] + outcomes
            Path(args.out).write_text(
                render(cells, runs=[*runs, run], models_total=len(passing), findings=findings)
            )
            if args.json:
                data = {"runs": [*runs, run], "findings": findings, "outcomes": [o.__dict__ for o in cells]}
                Path(args.json).write_text(json.dumps(data, indent=1))
    failed = [o for o in outcomes if o.status != "pass"]
    print(f"{len(outcomes) - len(failed)} passed, {len(failed)} not passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
