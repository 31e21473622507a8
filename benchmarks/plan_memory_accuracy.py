"""Memory estimate (`recipes validate` / `recipes plan`) vs the measured peak of real training steps.

The CPU suite checks 11 layouts within 10% (packages/recipes/tests/test_plan_memory.py); this sweep
adds layouts the suite leaves out (plain dp2, HSDP 2x2, tp2 without SP) and prints, per layout,
the estimate, the measurement (the allocator's live bytes of the training thread at the highest
point of step 2, busiest rank) and their ratio. With expert parallelism the estimate is given the
expert load factor measured in the same step (the busiest ep rank's routed rows over the mean);
the balanced estimate (factor 1) is printed beside it.

    uv run --frozen python benchmarks/plan_memory_accuracy.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "recipes" / "tests"))
from test_plan_memory import DENSE, LAYOUTS, estimate, measure, recipe  # noqa: E402

#: name -> (ranks, distributed section, local batch, global batch, model): beyond the suite's layouts.
EXTRA = {
    "fsdp2_dp2": (2, {}, 2, 4, DENSE),
    "hsdp_2x2": (4, {"dp_replicate_size": 2}, 2, 8, DENSE),
    "tp2": (2, {"tp_size": 2}, 2, 2, DENSE),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated layout names")
    args = parser.parse_args()
    LAYOUTS.update(EXTRA)
    names = args.only.split(",") if args.only else list(LAYOUTS)
    print(
        f"{'layout':<16} {'ranks':>5} {'estimate MiB':>13} {'measured MiB':>13} {'est/meas':>9} "
        f"{'load factor':>12} {'balanced est/meas':>18}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            world, raw = recipe(name, str(Path(tmp) / name))
            measured, load = measure(raw, world)
            estimated = estimate(raw, world, expert_load_factor=load).peak_bytes
            balanced = estimate(raw, world).peak_bytes
            print(
                f"{name:<16} {world:>5} {estimated / 2**20:>13.2f} {measured / 2**20:>13.2f} "
                f"{estimated / measured:>9.3f} {load:>12.3f} {balanced / measured:>18.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
