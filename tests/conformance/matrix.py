"""Conformance: every causal LM in transformers' registry through the recipes, one process vs each layout.

For each model_type of ``AutoModelForCausalLM``'s mapping a tiny config (the config class's own
defaults, sizes shrunk; see `tiny.py`) is trained for a few fp32 steps through the code path of
`recipes train` (`plan_layout`'s pre-launch checks, then `run_training` on forked gloo ranks):
once in one process, then under each layout. A case passes when every step's loss and gradient
norm equal the single-process run (relative 1e-5) and every rank holds what the layout asks for
(read from the ranks' layout reports). The only other acceptable outcome is a refusal before
launch with a message; anything else (a different loss, a crash inside the ranks) is a failure.

    uv run --frozen python tests/conformance/matrix.py            # full sweep, writes docs/models.md
    uv run --frozen python tests/conformance/matrix.py --models llama,gpt2 --layouts tp2,pp2
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from automodel.testing.layout_check import check_layout_applied
from automodel.testing.layout_table import Layout, layouts_named

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from matrix_doc import Outcome, header, merge, read, render  # noqa: E402
from tiny import NOT_STANDALONE, settable, tiny_overrides  # noqa: E402

STEPS = 3
RTOL = 1e-5
#: Plain SGD: Adam divides each gradient entry by its own magnitude, so entries that are rounding
#: noise (|g| ~ 1e-9 under another reduction order) become full-size updates and one process and
#: a layout drift apart after a step without any bug. SGD keeps the noise at its size, so the
#: comparison stays sharp; Adam's sharded state is covered by the parity matrix (tests/parity_matrix.py).
OPTIMIZER = "torch.optim.SGD"
LR = 0.1
RANK_TIMEOUT_S = 150
#: Largest tiny model (parameters) a sweep builds; configs that nest big sub-configs stay larger.
MAX_TINY_PARAMS = 10_000_000

#: The sweep's layouts: docs/models.md's column names for shared layouts (`automodel.testing.layout_table`),
#: each with the strategy named (the composed 4-rank ones and pp2_ac are in the CPU suite's cases,
#: not the sweep's columns; pp2_ac: two stages per rank with checkpointing inside them; ep2_pp2_ac:
#: one layer per stage, so a stage may hold only dense layers, as DeepSeek-V3's first layers).
_SHARED_NAMES = {
    "fsdp2": "fsdp2_dp2",
    "tp2": "tp2",
    "tp2_sp": "tp2_sp",
    "pp2": "pp2_1f1b",
    "cp2": "cp2",
    "pp2_ac": "pp2_ac",
    "ep2": "ep2",
    "tp2_pp2": "pp2xtp2",
    "tp2_sp_pp2": "pp2xtp2_sp",
    "cp2_pp2": "pp2xcp2",
    "ep2_cp2": "ep2xcp2",
    "ep2_pp2": "pp2xep2",
    "ep2_pp2_ac": "pp2xep2_ac",
}
#: The shared table's entry of each column (what `check_applied` checks).
SHARED: dict[str, Layout] = dict(zip(_SHARED_NAMES, layouts_named(*_SHARED_NAMES.values()), strict=True))
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    column: (shared.ranks, {"strategy": "fsdp2", **shared.distributed}) for column, shared in SHARED.items()
}
DENSE_LAYOUTS = ("fsdp2", "tp2", "tp2_sp", "pp2", "cp2")
MOE_LAYOUTS = ("fsdp2", "tp2", "pp2", "ep2")
#: Variants switch on options that change the math; they run where those options matter most.
VARIANT_LAYOUTS = ("tp2", "pp2")

#: Options that change the math, switched on when the config has the field: (field, value).
_MATH_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("embedding_multiplier", 3.0),
    ("residual_multiplier", 0.5),
    ("attention_multiplier", 0.3),
    ("logits_scaling", 2.0),
    ("logit_scale", 0.5),
    ("final_logit_softcapping", 5.0),
    ("attn_logit_softcapping", 20.0),
    ("sliding_window", 8),
    ("use_sliding_window", True),
    ("attention_bias", True),
    ("mlp_bias", True),
    ("use_qk_norm", True),
    ("qk_layernorm", True),
)


# ---- the registry and its tiny configs ------------------------------------------------------
def registry_model_types() -> list[str]:
    """Every model_type that ``AutoModelForCausalLM`` maps (transformers' own registry)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


#: Swept first (widely used decoder families), so an interrupted sweep still covers them.
COMMON_FIRST = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi",
    "phi3",
    "granite",
    "cohere",
    "cohere2",
    "olmo",
    "olmo2",
    "olmo3",
    "starcoder2",
    "glm",
    "glm4",
    "stablelm",
    "smollm3",
    "gpt2",
    "gpt_neox",
    "opt",
    "bloom",
    "falcon",
    "mpt",
    "gptj",
    "gpt_bigcode",
    "nemotron",
    "exaone4",
    "helium",
    "seed_oss",
    "ministral",
    "internlm3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "gpt_oss",
    "granitemoe",
    "phimoe",
    "jetmoe",
    "dbrx",
    "minimax",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "llama4_text",
    "qwen3_next",
    "jamba",
    "mamba",
)


def prioritized(model_types: list[str]) -> list[str]:
    first = [m for m in COMMON_FIRST if m in model_types]
    return first + [m for m in model_types if m not in first]


def tiny_model_config(model_type: str, variant: str = "default") -> dict[str, Any]:
    """The YAML ``model.config`` of the tiny `model_type` (`variant`: default, options, tie_flipped,
    fewer_kv_heads: half as many key/value heads as attention heads)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    out = tiny_overrides(config)
    if variant == "options":
        changed = {k: v for k, v in _MATH_OPTIONS if hasattr(config, k) and settable(config, k, v)}
        if not changed:
            raise LookupError(f"{model_type} has none of the math options")
        out.update(changed)
    elif variant == "tie_flipped":
        if not hasattr(config, "tie_word_embeddings"):
            raise LookupError(f"{model_type} has no tie_word_embeddings")
        out["tie_word_embeddings"] = not bool(config.tie_word_embeddings)
    elif variant == "fewer_kv_heads":
        if "num_key_value_heads" not in out or "num_attention_heads" not in out:
            raise LookupError(f"{model_type} has no num_key_value_heads")
        out["num_key_value_heads"] = out["num_attention_heads"] // 2
    if variant != "default":
        try:
            AutoConfig.for_model(model_type, **out)
        except Exception as err:  # the config class rejects the option (DBRX: no tied embeddings)
            raise LookupError(f"{model_type} rejects the {variant} variant: {err}") from None
    return {"model_type": model_type, **out}


def recipe_config(
    model_config: dict[str, Any], distributed: dict[str, Any], output_dir: str
) -> dict[str, Any]:
    return {
        "seed": 5,
        "output_dir": output_dir,
        "model": {"config": copy.deepcopy(model_config), "dtype": "float32"},
        "dataset": {"source": "embedded", "seq_length": 32, "max_bytes": 20000},
        "step_scheduler": {"global_batch_size": 4, "local_batch_size": 2, "max_steps": STEPS},
        "optimizer": {"_target_": OPTIMIZER, "lr": LR, "foreach": False},
        "lr_scheduler": {"warmup_steps": 0, "decay_style": "constant"},
        "distributed": copy.deepcopy(distributed),
        "checkpoint": {"enabled": False},
        "logging": {"progress_bar": False, "layout_report": "all"},
    }


# ---- running -----------------------------------------------------------------------------------
def _train_rank(raw: dict[str, Any]) -> None:
    from automodel.recipes.recipe_config import parse_recipe_config
    from automodel.recipes.trainer import run_training

    run_training(parse_recipe_config(raw))


class Refused(Exception):  # noqa: N818 - an outcome, not an error
    """Refused before launch (the recipes' ConfigError)."""


def run_case(raw: dict[str, Any], ranks: int) -> tuple[list[dict[str, float]], list[dict[str, Any]]]:
    """Pre-launch checks, then training on `ranks` forked ranks: (per-step metrics, rank reports)."""
    from automodel.recipes.errors import ConfigError
    from automodel.recipes.plan import plan_layout
    from automodel.recipes.recipe_config import parse_recipe_config
    from automodel.testing.ranks import run_on_ranks

    try:
        plan_layout(parse_recipe_config(copy.deepcopy(raw)), world_size=ranks)
    except ConfigError as err:
        raise Refused(str(err)) from None
    run_on_ranks(_train_rank, world_size=ranks, args=(raw,), timeout_s=RANK_TIMEOUT_S)
    out = Path(raw["output_dir"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    reports = [json.loads((out / "layout" / f"rank_{r}.json").read_text()) for r in range(ranks)]
    return [{"loss": float(m["loss"]), "grad_norm": float(m["grad_norm"])} for m in metrics], reports


def max_relative_difference(got: list[dict[str, float]], ref: list[dict[str, float]]) -> float:
    if len(got) != len(ref):
        return float("inf")
    return max(
        abs(g[k] - r[k]) / max(abs(r[k]), 1e-12) for g, r in zip(got, ref) for k in ("loss", "grad_norm")
    )


#: A model whose own training amplifies rounding (Gemma 4's tiny default: one process with eager
#: attention instead of sdpa, both exact, differs by 8e-5 at step 3; DiffLlama's differential
#: attention by 7e-6 at step 1) cannot be held to RTOL where that noise exceeds it. Each step may
#: differ by up to NOISE_FACTOR times the noise measured up to that step, and never less than RTOL.
NOISE_FACTOR = 4


def reference_noise(
    model_config: dict[str, Any], output_dir: Path, ref: list[dict[str, float]]
) -> list[float]:
    """Per step, how far one process's own metrics have moved so far when attention is computed
    another exact way (eager instead of the default): this model's rounding noise (zeros where
    eager is its default or is refused)."""
    raw = recipe_config(model_config, {"strategy": "fsdp2"}, str(output_dir))
    raw["model"]["attn_implementation"] = "eager"
    try:
        again, _ = run_case(raw, 1)
    except Refused:
        return [0.0] * len(ref)
    if len(again) != len(ref):
        return [0.0] * len(ref)
    steps = [max_relative_difference([a], [r]) for a, r in zip(again, ref)]
    return [max(steps[: i + 1]) for i in range(len(steps))]  # rounding compounds: the envelope


def within_tolerance(
    got: list[dict[str, float]], ref: list[dict[str, float]], noise: list[float] | None
) -> tuple[bool, float]:
    """(every step agrees, the largest relative difference): step i to
    max(RTOL, NOISE_FACTOR * noise[i])."""
    rel = max_relative_difference(got, ref)
    if len(got) != len(ref):
        return False, rel
    noise = noise or [0.0] * len(ref)
    ok = all(
        max_relative_difference([g], [r]) <= max(RTOL, NOISE_FACTOR * n) for g, r, n in zip(got, ref, noise)
    )
    return ok, rel


# ---- what each rank holds ----------------------------------------------------------------------
def check_applied(
    layout: str, reports: list[dict[str, Any]], *, num_layers: int, num_experts: int | None
) -> None:
    """AssertionError unless every rank holds what conformance `layout` asks for (the shared
    checker, `automodel.testing.layout_check.check_layout_applied`, generic over architectures)."""
    check_layout_applied(
        reports,
        layout=SHARED[layout],
        layers=num_layers,
        num_experts=num_experts,
        any_architecture=True,
    )


# ---- one model, all its cases --------------------------------------------------------------------
def _model_facts(model_config: dict[str, Any]) -> tuple[int, int | None, int]:
    """(decoder layers, experts, parameters) of the tiny model, built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from automodel.recipes.model import num_experts

    kwargs = dict(model_config)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from automodel.mesh.model_parts import find_layer_list

    found = find_layer_list(model)
    return (len(found[1]) if found else 0), num_experts(config), sum(p.numel() for p in model.parameters())


def run_model(
    model_type: str, *, layouts: tuple[str, ...] | None = None, variants: bool = True, workdir: Path
) -> list[Outcome]:
    """Every case of one model_type (the default tiny config on each layout, then the variants)."""
    outcomes: list[Outcome] = []
    plan: list[tuple[str, tuple[str, ...]]] = [("default", ())]
    if model_type in NOT_STANDALONE:
        return [Outcome(model_type, "default", "*", "n/a", NOT_STANDALONE[model_type])]
    try:
        base = tiny_model_config(model_type)
        num_layers, experts, params = _model_facts(base)
    except Exception as err:  # the registry entry itself cannot be built as a tiny causal LM
        return [Outcome(model_type, "default", "*", "n/a", f"tiny config not buildable: {_short(err)}")]
    if params > MAX_TINY_PARAMS:
        return [
            Outcome(model_type, "default", "*", "n/a", f"not tiny ({params:,} parameters with shrunk sizes)")
        ]
    kind_layouts = MOE_LAYOUTS if experts else DENSE_LAYOUTS
    plan[0] = ("default", tuple(x for x in kind_layouts if layouts is None or x in layouts))
    if variants:
        for variant in ("options", "tie_flipped"):
            try:
                tiny_model_config(model_type, variant)
            except LookupError:
                continue
            plan.append((variant, tuple(x for x in VARIANT_LAYOUTS if layouts is None or x in layouts)))
    for variant, variant_layouts in plan:
        if not variant_layouts:
            continue
        outcomes += run_layouts(
            model_type,
            variant,
            variant_layouts,
            case_dir=workdir / f"{model_type}-{variant}",
            num_layers=num_layers,
            experts=experts,
        )
    return outcomes


def run_layouts(
    model_type: str,
    variant: str,
    layouts: tuple[str, ...],
    *,
    case_dir: Path,
    num_layers: int,
    experts: int | None,
) -> list[Outcome]:
    """One process of the tiny `model_type` `variant`, then each of `layouts` against it."""
    model_config = tiny_model_config(model_type, variant)
    try:
        ref, _ = run_case(recipe_config(model_config, {"strategy": "fsdp2"}, str(case_dir / "ref")), 1)
    except Refused as err:
        return [Outcome(model_type, variant, x, "refused", str(err)) for x in layouts]
    except Exception as err:
        return [Outcome(model_type, variant, x, "FAIL", f"one process: {_short(err)}") for x in layouts]
    outcomes: list[Outcome] = []
    noise: list[float] | None = None  # measured only when a layout needs more than RTOL
    for layout in layouts:
        ranks, distributed = LAYOUTS[layout]
        raw = recipe_config(model_config, distributed, str(case_dir / layout))
        try:
            got, reports = run_case(raw, ranks)
            rel = max_relative_difference(got, ref)
            if rel > RTOL and noise is None:
                noise = reference_noise(model_config, case_dir / "ref_eager", ref)
            ok, rel = within_tolerance(got, ref, noise)
            shown = ", ".join(f"{n:.1e}" for n in noise or ())
            if not ok:
                detail = f"max rel diff {rel:.2e}" + (
                    f" (own rounding noise by step: {shown})" if noise else ""
                )
                outcomes.append(Outcome(model_type, variant, layout, "FAIL", detail, rel))
                continue
            check_applied(layout, reports, num_layers=num_layers, num_experts=experts)
            rounding = (
                f"{rel:.1e} off, within {NOISE_FACTOR}x the model's own rounding noise (by step: {shown})"
                if rel > RTOL
                else ""
            )
            outcomes.append(Outcome(model_type, variant, layout, "pass", rounding, rel))
        except Refused as err:
            outcomes.append(Outcome(model_type, variant, layout, "refused", str(err)))
        except AssertionError as err:
            outcomes.append(Outcome(model_type, variant, layout, "FAIL", f"not applied: {_short(err)}"))
        except Exception as err:
            outcomes.append(Outcome(model_type, variant, layout, "FAIL", _short(err)))
    return outcomes


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    # A rank failure carries the rank's traceback: its last line is the cause.
    last = [line for line in text if line.strip()][-1:] or [type(err).__name__]
    return f"{type(err).__name__}: {last[0].strip()[:300]}"


# ---- the matrix ---------------------------------------------------------------------------------
def write_matrix(outcomes: list[Outcome], path: Path, *, runs: list[str]) -> None:
    """docs/models.md from `outcomes` (see `matrix_doc`), listing the `runs` that produced it."""
    path.write_text(
        render(outcomes, head=header(steps=STEPS, lr=LR, rtol=RTOL, noise_factor=NOISE_FACTOR), runs=runs)
    )


def _run_line(argv: list[str], *, seconds: float, partial: str = "") -> str:
    """One entry of the page's run list: date, command, versions, duration."""
    import datetime

    import torch
    import transformers

    command = " ".join(["tests/conformance/matrix.py", *argv])
    return (
        f"{datetime.date.today()}: `{command}`, transformers {transformers.__version__}, "
        f"torch {torch.__version__}, CPU, {seconds / 60:.0f} min{partial}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated model_types (default: the whole registry)")
    parser.add_argument("--layouts", help="comma-separated layouts (default: all that apply)")
    parser.add_argument("--no-variants", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "docs" / "models.md"))
    parser.add_argument("--json", default=None, help="also write the outcomes as JSON here")
    parser.add_argument(
        "--resume", default=None, help="JSON of an earlier sweep: keep its models, run the rest"
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="re-test only the given models/layouts and keep every other cell of --out",
    )
    args = parser.parse_args(argv)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    models = args.models.split(",") if args.models else prioritized(registry_model_types())
    layouts = tuple(args.layouts.split(",")) if args.layouts else None
    outcomes: list[Outcome] = []
    if args.resume:
        outcomes = [Outcome(**o) for o in json.loads(Path(args.resume).read_text())]
        done = {o.model_type for o in outcomes}
        models = [m for m in models if m not in done]
    kept: list[Outcome] = []
    runs: list[str] = []
    if args.update:
        if not (args.models or args.layouts):
            parser.error("--update re-tests some cells: give --models and/or --layouts")
        kept, runs = read(Path(args.out))
    shown_argv = list(argv if argv is not None else sys.argv[1:])
    start = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for i, model_type in enumerate(models, 1):
            t0 = time.time()
            try:
                got = run_model(model_type, layouts=layouts, variants=not args.no_variants, workdir=Path(tmp))
            except Exception:
                got = [Outcome(model_type, "default", "*", "FAIL", traceback.format_exc(limit=2)[-300:])]
            outcomes += got
            summary = ", ".join(f"{o.variant}/{o.layout}={o.status}" for o in got)
            print(f"[{i}/{len(models)}] {model_type} ({time.time() - t0:.0f}s): {summary}", flush=True)
            # Written after every model, so an interrupted sweep still leaves its table.
            swept, registry = len({o.model_type for o in outcomes}), len(registry_model_types())
            partial = (
                f", partial: {swept} of {registry} registry entries"
                if not args.update and swept < registry
                else ""
            )
            run = _run_line(shown_argv, seconds=time.time() - start, partial=partial)
            whole = layouts is None and not args.no_variants
            write_matrix(merge(kept, outcomes, whole=whole), Path(args.out), runs=[*runs, run])
            if args.json:
                Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    failed = [o for o in outcomes if o.status == "FAIL"]
    print(f"{sum(o.status == 'pass' for o in outcomes)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
