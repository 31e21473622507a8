"""Composed layouts on real architectures: writes docs/composed.md.

The conformance matrix (docs/models.md) proves each parallelism alone on every registry model;
users combine them. This sweep runs the tiny config of each given model_type once in one process
and then under each composed 4-rank layout of `matrix.LAYOUTS` (pipeline with TP, TP + SP, CP or
EP; EP with CP), with the matrix's criterion: every step's loss and gradient norm within 1e-5 of
one process (or the model's own rounding envelope), and every axis of the layout really applied on
every rank (`matrix.check_applied`).

    uv run --frozen python tests/conformance/composed.py                 # the default model list
    uv run --frozen python tests/conformance/composed.py --models llama,qwen3_moe
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from matrix import RTOL, _model_facts, run_layouts, tiny_model_config  # noqa: E402
from matrix_doc import Outcome, cell  # noqa: E402

DENSE = ("tp2_pp2", "tp2_sp_pp2", "cp2_pp2")
MOE = ("ep2_pp2", "ep2_pp2_ac", "ep2_cp2")
COLUMNS = DENSE + MOE
#: Widely used families first; MoE models get the MoE columns.
MODELS = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "gemma3n_text", "gemma4_text",
    "phi3", "granite", "cohere", "olmo2", "starcoder2", "glm4", "smollm3", "minicpm3", "nemotron",
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss", "glm4_moe",
    "granitemoe", "phimoe", "llama4_text", "dbrx", "ernie4_5_moe", "hunyuan_v1_moe", "dots1", "qwen3_next",
    "minimax", "flex_olmo",
)  # fmt: skip


def render(outcomes: list[Outcome], *, runs: list[str]) -> str:
    rows: dict[str, dict[str, Outcome]] = {}
    for o in outcomes:
        rows.setdefault(o.model_type, {})[o.layout] = o
    counts = [
        f"{c} {sum(r[c].status == 'pass' for r in rows.values() if c in r)}/{sum(c in r for r in rows.values())}"
        for c in COLUMNS
    ]
    lines = [
        "# Composed layouts on real architectures",
        "",
        "The tiny config of each model_type (as in docs/models.md) trained 3 SGD steps in fp32 through the",
        "recipes' code path, once in one process and once under each composed layout on 4 gloo ranks:",
        "`tp2_pp2` (tp 2 x pp 2, 1F1B), `tp2_sp_pp2` (the same with sequence parallel), `cp2_pp2` (cp 2 x pp 2),",
        "`ep2_pp2` (ep 2 over dp 2 x pp 2), `ep2_pp2_ac` (interleaved 1F1B, one layer per stage, activation",
        "checkpointing), `ep2_cp2` (ep 2 over dp_cp = cp 2 x dp 2). **pass**: every step's loss and gradient",
        f"norm within {RTOL:g} relative of one process (or the model's own rounding envelope, as in",
        "docs/models.md) and every rank holds what each axis asks for (`matrix.check_applied`: stages",
        "disjoint by pp coordinate, tp shards in every held layer, SP norms on the tp mesh, the CP ring,",
        "experts split over ep, activation checkpointing). **refused**: stopped before launch (message",
        "in the notes). Dense models run the dense columns, MoE models the MoE ones.",
        "",
        "## Runs",
        "",
        *[f"- {run}" for run in runs],
        "",
        "Passing: " + ", ".join(counts),
        "",
        "| model_type | " + " | ".join(COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    notes: list[str] = []
    for model_type, cells in rows.items():
        shown = [cell(cells.get(c), notes, label=f"`{model_type}` {c}") for c in COLUMNS]
        lines.append(f"| {model_type} | " + " | ".join(shown) + " |")
    lines += ["", "## Notes", "", *[f"{i}. {n}" for i, n in enumerate(notes, 1)], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated model_types (default: a list of common families)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "composed.md"))
    args = parser.parse_args(argv)
    import torch
    import transformers

    models = args.models.split(",") if args.models else list(MODELS)
    outcomes: list[Outcome] = []
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, model_type in enumerate(models, 1):
            num_layers, experts, _ = _model_facts(tiny_model_config(model_type))
            got = run_layouts(
                model_type,
                "default",
                MOE if experts else DENSE,
                case_dir=Path(tmp) / model_type,
                num_layers=num_layers,
                experts=experts,
            )
            outcomes += got
            print(
                f"[{i}/{len(models)}] {model_type}: " + ", ".join(f"{o.layout}={o.status}" for o in got),
                flush=True,
            )
    command = " ".join(["tests/conformance/composed.py", *(argv if argv is not None else sys.argv[1:])])
    run = (
        f"{datetime.date.today()}: `{command}`, transformers {transformers.__version__}, torch {torch.__version__}, "
        f"CPU, {(time.time() - start) / 60:.0f} min"
    )
    Path(args.out).write_text(render(outcomes, runs=[run]))
    failed = [o for o in outcomes if o.status == "FAIL"]
    print(f"{len(outcomes) - len(failed)} passed or refused, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
