"""Memory estimate (`recipes validate` / `recipes plan`) vs the measured peak of real training steps.

The CPU suite checks 11 layouts within 10% (packages/recipes/tests/test_plan_memory.py); this sweep
adds layouts the suite leaves out (plain dp2, HSDP 2x2, tp2 without SP, MoE ep2 without AC) and
prints, per layout, the estimate, the measurement (the allocator's live bytes of the training
thread at the highest point of step 2, busiest rank) and their ratio.

    uv run --frozen python benchmarks/plan_memory_accuracy.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "recipes" / "tests"))
from test_plan_memory import DENSE, LAYOUTS, MOE, estimate, measure_on_rank, recipe  # noqa: E402

from automodel.mesh.testing import run_on_ranks  # noqa: E402

#: name -> (ranks, distributed section, local batch, global batch, model): beyond the suite's layouts.
EXTRA = {
    "fsdp2_dp2": (2, {}, 2, 4, DENSE),
    "hsdp_2x2": (4, {"dp_replicate_size": 2}, 2, 8, DENSE),
    "tp2": (2, {"tp_size": 2}, 2, 2, DENSE),
    "moe_ep2": (2, {"ep_size": 2}, 2, 4, MOE),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated layout names")
    args = parser.parse_args()
    LAYOUTS.update(EXTRA)
    names = args.only.split(",") if args.only else list(LAYOUTS)
    print(f"{'layout':<16} {'ranks':>5} {'estimate MiB':>13} {'measured MiB':>13} {'est/meas':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            world, raw = recipe(name, str(Path(tmp) / name))
            measured = max(run_on_ranks(measure_on_rank, world_size=world, args=(raw,), timeout_s=600))
            estimated = estimate(raw, world).peak_bytes
            print(
                f"{name:<16} {world:>5} {estimated / 2**20:>13.2f} {measured / 2**20:>13.2f} "
                f"{estimated / measured:>9.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
