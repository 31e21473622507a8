"""The recipes' Python API: what `recipes train` does, callable from a script.

    from automodel.recipes import load_config, train

    cfg = load_config("examples/quickstart.yaml", overrides=["--step_scheduler.max_steps=5"])
    result = train(cfg)  # in each process torchrun started (or in one plain process)
    print(result.losses)

`load_config` is the one path from YAML to a validated `RecipeConfig`, shared by the CLI's
`train` and `validate`; `train` resolves the config in this process (`resolved_run.resolve_run`,
the resolution every path shares: the same refusals, with the same messages, as `recipes train`
and `recipes validate`) before it builds anything, unless it is handed a `ResolvedRun` (the
`recipes` launcher's), then trains and tears the process group down (also on failure).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel.mesh import destroy_distributed
from automodel.recipes.loader import apply_overrides
from automodel.recipes.loader import load_config as load_config_file
from automodel.recipes.recipe_config import RecipeConfig, parse_recipe_config
from automodel.recipes.resolved_run import ResolvedRun
from automodel.recipes.trainer import run_training

if TYPE_CHECKING:
    from automodel.recipes.trainer import TrainResult


def load_config(source: str | Path | dict[str, Any], *, overrides: Sequence[str] = ()) -> RecipeConfig:
    """A YAML file (or an already-loaded mapping) plus ``--section.key=value`` overrides, validated.

    A mapping without ``output_dir`` gets ``runs/config``; a file gets ``runs/<file stem>``.
    Every mistake raises `ConfigError` naming the key and the value.
    """
    if isinstance(source, dict):
        raw = apply_overrides(source, list(overrides))
        raw.setdefault("output_dir", str(Path("runs") / "config"))
    else:
        raw = load_config_file(source, list(overrides))
    return parse_recipe_config(raw)


def train(
    config: ResolvedRun | RecipeConfig | str | Path | dict[str, Any], *, overrides: Sequence[str] = ()
) -> TrainResult:
    """Train `config` in this process, one rank of the job (world size from torchrun's environment).

    A `ResolvedRun` (resolved once by the `recipes` launcher for every rank of its machine) is
    trained as is: the rank checks only its own process group; anything else is resolved here.
    The process group is created here and destroyed when training ends or fails.
    """
    run = (
        config if isinstance(config, RecipeConfig | ResolvedRun) else load_config(config, overrides=overrides)
    )
    try:
        result = run_training(run)
    except BaseException:
        destroy_distributed(barrier=False)  # peers may be stuck in a collective: fail, don't hang
        raise
    destroy_distributed()
    return result
