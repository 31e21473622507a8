"""`recipes validate` of a 16,384-rank 70B job with the full memory estimate (target: < 10 s).

The CLI is run `--repeats` times as `python -m automodel.recipes.cli` (with `--uv` also as
`uv run --frozen recipes`); the minimum wall and CPU (user+sys of the child processes) are
reported, since the machine may be shared (its load average is printed). In-process, the phases of
`plan_layout` are timed on a first (cold) call and a second (warm) one: the warm call is the
validation work alone, the cold call's excess is the imports its steps trigger.

    uv run --frozen python benchmarks/validate_time.py [--repeats 3] [--uv]
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "llama3_70b_64gpu.yaml"
WORLD = 16_384
OVERRIDES = [f"--step_scheduler.global_batch_size={WORLD}"]
VALIDATE = ["validate", str(CONFIG), f"--world-size={WORLD}", *OVERRIDES]
IMPORTS = "import torch, automodel.{mesh,pipeline,recipes}"
PHASES = (
    IMPORTS,
    "load_config",
    "HF config",
    "meta-device model",
    "rules (incl. pipeline split trace)",
    "  of which the pipeline split trace",
    "MeshContext.build",
    "memory estimate",
    "plan_layout total",
)


def run_cli(command: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds (user+sys of every child process) of one run of `command`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def timed(totals: dict[str, float], name: str, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.process_time() - start

    return wrapper


def in_process_phases() -> list[dict[str, float]]:
    """CPU seconds per phase of `load_config` + `plan_layout`, for a cold and a warm call."""
    start = time.process_time()
    import automodel.pipeline as pipeline
    from automodel.mesh import MeshContext
    from automodel.recipes import launch_check, plan
    from automodel.recipes.api import load_config

    runs = []
    for _ in range(2):
        totals: dict[str, float] = defaultdict(float)
        if not runs:
            totals[IMPORTS] = time.process_time() - start
        build = MeshContext.__dict__["build"]
        patches = {
            (launch_check, "build_hf_config"): "HF config",
            (launch_check, "build_meta_model"): "meta-device model",
            (launch_check, "check_layout_rules"): "rules (incl. pipeline split trace)",
            (pipeline, "validate_hf_model_for_pipeline_support"): "  of which the pipeline split trace",
            (plan, "estimate_memory"): "memory estimate",
        }
        originals = {key: getattr(*key) for key in patches}
        for (module, attr), name in patches.items():
            setattr(module, attr, timed(totals, name, originals[(module, attr)]))
        setattr(MeshContext, "build", classmethod(timed(totals, "MeshContext.build", build.__func__)))  # noqa: B010
        try:
            t0 = time.process_time()
            cfg = load_config(CONFIG, overrides=OVERRIDES)
            totals["load_config"] = time.process_time() - t0
            t0 = time.process_time()
            plan.plan_layout(cfg, world_size=WORLD)
            totals["plan_layout total"] = time.process_time() - t0
        finally:
            for (module, attr), fn in originals.items():
                setattr(module, attr, fn)
            MeshContext.build = build
        runs.append(dict(totals))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--uv", action="store_true", help="also time `uv run --frozen recipes validate`")
    args = parser.parse_args()

    commands = {
        "python -m automodel.recipes.cli validate": [sys.executable, "-m", "automodel.recipes.cli", *VALIDATE]
    }
    if args.uv:
        commands["uv run --frozen recipes validate"] = ["uv", "run", "--frozen", "recipes", *VALIDATE]
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for label, command in commands.items():
        runs = [run_cli(command) for _ in range(args.repeats)]
        walls = ", ".join(f"{w:.2f}" for w, _ in runs)
        print(
            f"{label}: wall min {min(w for w, _ in runs):.2f} s, CPU min {min(c for _, c in runs):.2f} s  (walls {walls})"
        )

    cold, warm = in_process_phases()
    print(f"\n{'in-process phase (CPU s)':<50}{'cold':>8}{'warm':>8}")
    for name in PHASES:
        print(f"{name:<50}{cold[name]:>8.2f}{warm.get(name, 0.0):>8.2f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
