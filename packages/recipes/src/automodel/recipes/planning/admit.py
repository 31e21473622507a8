"""`recipes plan` proposes only layouts `recipes train` accepts: each one, as the recipe YAML it
prints, goes through the resolution every path shares (`resolved_run.resolve_run`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml
from torch import nn

from automodel.recipes.api import load_config
from automodel.recipes.errors import ConfigError
from automodel.recipes.planning.search import Candidate
from automodel.recipes.planning.table import yaml_block
from automodel.recipes.planning.terms import batch_ranks_of
from automodel.recipes.resolved_run import resolve_run
from automodel.recipes.rules import ModelChecks

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def global_batch_of(c: Candidate) -> int:
    """The global batch of a candidate: local batch x data-parallel ranks x accumulation."""
    s = c.setup
    return s.local_batch * batch_ranks_of(s) * s.grad_accum


def layout_key(c: Candidate) -> tuple:
    """A candidate's layout: its sizes and the parallelisms' options (pp's schedule)."""
    s = c.setup
    return (s.sizes, s.options)


def _model_section(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The model as a recipe's ``model.config``: the values that differ from the class's defaults
    (what `model.build_hf_config` builds the same config from)."""
    data = hf_config.to_diff_dict()
    return {k: v for k, v in data.items() if not k.startswith("_") and k != "transformers_version"}


def candidate_recipe(
    c: Candidate, *, hf_config: PretrainedConfig, seq_len: int, peft: str | None
) -> dict[str, Any]:
    """The recipe `recipes plan` stands for with `c`: its printed YAML block, the model and the
    sequence length (``dataset.seq_length``), LoRA's default section with ``--peft lora``."""
    raw = yaml.safe_load("\n".join(yaml_block(c, global_batch=global_batch_of(c))))
    raw["model"] = {"config": _model_section(hf_config)}
    raw["dataset"] = {"seq_length": seq_len}
    raw["output_dir"] = "runs/plan"
    if peft == "lora":
        raw["peft"] = {}
    return raw


@dataclass
class Admission:
    """The admitted candidates (best first, one per layout) and the refusals met on the way."""

    admitted: list[Candidate]
    refusals: list[tuple[Candidate, ConfigError]]

    def refusal_lines(self) -> list[str]:
        """One line per distinct refusal message, with how many layouts it refused."""
        counts = Counter(str(e) for _, e in self.refusals)
        return [f"  {n} layout{'s' * (n > 1)}: {message}" for message, n in counts.items()]


def admit_layouts(
    cands: list[Candidate],
    *,
    top: int,
    gpus: int,
    hf_config: PretrainedConfig,
    model: nn.Module,
    seq_len: int,
    peft: str | None,
) -> Admission:
    """The best candidate of each distinct layout that passes `resolve_run` for `gpus` ranks
    (as `recipes validate` runs it: for another machine), up to `top` of them.

    `cands` are ranked best first; each layout is checked once (its best candidate's batch)."""
    seen: set[tuple] = set()
    model_checks: ModelChecks = {}  # one model: its checks depend on a few flags, not on the sizes
    out = Admission(admitted=[], refusals=[])
    for c in cands:
        key = layout_key(c)
        if key in seen:
            continue
        seen.add(key)
        try:
            cfg = load_config(candidate_recipe(c, hf_config=hf_config, seq_len=seq_len, peft=peft))
            resolve_run(
                cfg,
                world_size=gpus,
                this_machine=False,
                hf_config=hf_config,
                model=model,
                model_checks=model_checks,
            )
        except ConfigError as e:
            out.refusals.append((c, e))
            continue
        out.admitted.append(c)
        if len(out.admitted) == top:
            break
    return out
