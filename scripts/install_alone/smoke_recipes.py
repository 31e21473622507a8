"""install_alone smoke for automodel-recipes: the installed `recipes` script prints the versions,
plans the layout for 2 ranks (fake process group) and trains 2 steps of the quickstart in one process.

Usage: python smoke_recipes.py QUICKSTART_YAML   (run in an empty directory; writes runs/ there)
"""

import json
import subprocess
import sys
from pathlib import Path

RECIPES = str(Path(sys.executable).with_name("recipes"))


def run(*args: str) -> str:
    proc = subprocess.run([RECIPES, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"recipes {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


if __name__ == "__main__":
    config = sys.argv[1]
    versions = run("--version")
    assert "automodel-recipes" in versions and "torch" in versions, versions
    run("validate", config, "--world-size", "2")
    out = Path("runs/smoke").resolve()
    run(
        "train",
        config,
        "--step_scheduler.max_steps=2",
        f"--output_dir={out}",
    )
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2], steps
    print(
        f"ok automodel-recipes: --version, validate (2 ranks), 2 training steps (loss {steps[-1]['loss']:.4f})"
    )
    print(versions.rstrip())
