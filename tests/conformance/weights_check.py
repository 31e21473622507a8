"""HF weights in and out, the check itself (used by `test_weights_in_out.py` and `weights_sweep.py`).

A tiny model of a registry model_type is saved with transformers' ``save_pretrained``; the recipes
load it (``model.pretrained_path``) into one process and into a layout and train one fp32 step.
Weights in: the first step's loss equals transformers' own loss of the loaded model on the same
batch (relative 1e-5). Weights out: the consolidated checkpoint each run writes loads back with
``from_pretrained`` with no missing or unexpected keys, and the layout's checkpoint gives the
one-process checkpoint's logits (1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matrix import LAYOUTS, recipe_config, run_case, tiny_model_config

RTOL = 1e-5
#: One step is enough: the checkpoint then holds trained (not initial) weights.
STEPS = 1


class WeightsMismatch(AssertionError):
    """Weights did not come in or go out as transformers has them (the message says which)."""


def save_tiny_pretrained(model_type: str, path: Path, *, seed: int = 1) -> Any:
    """Saves the tiny `model_type` with ``save_pretrained`` at `path`; the model reloaded from there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = tiny_model_config(model_type)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval()


def first_batch_loss(model: torch.nn.Module, raw: dict[str, Any]) -> float:
    """transformers' own loss on the recipes' first global batch (same data, sampler and seed)."""
    from automodel.recipes.data import ByteTokenizer, StatefulGlobalBatchSampler, build_packed_dataset
    from automodel.recipes.sections import DatasetSection

    ds = build_packed_dataset(DatasetSection(**raw["dataset"]), ByteTokenizer(), packed_sequence_size=0)
    gbs = raw["step_scheduler"]["global_batch_size"]
    sampler = StatefulGlobalBatchSampler(
        num_rows=len(ds), global_batch_size=gbs, local_batch_size=gbs, dp_rank=0, dp_size=1, seed=raw["seed"]
    )
    ids, labels, _ = ds.batch(sampler.next_step()[0])
    with torch.no_grad():
        return F.cross_entropy(model(input_ids=ids).logits.flatten(0, 1), labels.flatten()).item()


def pretrained_recipe_config(
    model_type: str, layout: str | None, pretrained: Path, output_dir: Path
) -> tuple[dict[str, Any], int]:
    """The recipe YAML (as a dict) loading `pretrained` into `layout` (None: one process), and its ranks."""
    ranks, distributed = LAYOUTS[layout] if layout else (1, {"strategy": "fsdp2"})
    raw = recipe_config({"model_type": model_type}, distributed, str(output_dir))
    raw["model"] = {"pretrained_path": str(pretrained), "dtype": "float32"}
    raw["step_scheduler"]["max_steps"] = STEPS
    raw["checkpoint"] = {"enabled": True, "save_consolidated": True}
    return raw, ranks


def train_from_pretrained(raw: dict[str, Any], ranks: int, expected_loss: float) -> Path:
    """Trains through the recipes' path; the consolidated checkpoint's directory.

    `matrix.Refused` when the recipes refuse the layout before launch, `WeightsMismatch` when the
    first step's loss is not transformers' `expected_loss`.
    """
    metrics, _ = run_case(raw, ranks)
    got = metrics[0]["loss"]
    if not abs(got - expected_loss) <= RTOL * abs(expected_loss):
        rel = abs(got - expected_loss) / abs(expected_loss)
        raise WeightsMismatch(
            f"weights in: first loss {got:.8g}, transformers {expected_loss:.8g} (rel {rel:.2e})"
        )
    return Path(raw["output_dir"]) / "checkpoints" / f"step_{STEPS}" / "consolidated"


def reload_logits(consolidated: Path, vocab_size: int) -> torch.Tensor:
    """Logits of the ``from_pretrained`` reload of `consolidated` on a fixed probe batch.

    `WeightsMismatch` when transformers reports missing, unexpected or mis-shaped keys (it would
    initialise those afresh and the logits could still agree by accident, e.g. norms of ones).
    """
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(consolidated, output_loading_info=True)
    bad = {k: sorted(v)[:4] for k, v in info.items() if k != "error_msgs" and v}
    if info.get("error_msgs"):
        bad["error_msgs"] = [str(e)[:200] for e in info["error_msgs"][:2]]
    if bad:
        raise WeightsMismatch(f"weights out: from_pretrained of the consolidated checkpoint reports {bad}")
    probe = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.eval()(input_ids=probe).logits


def compare_logits(got: torch.Tensor, ref: torch.Tensor) -> None:
    """`WeightsMismatch` unless the layout's reload gives the one-process reload's logits."""
    try:
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=RTOL)
    except AssertionError as err:
        lines = [line.strip() for line in str(err).splitlines() if "Greatest" in line]
        raise WeightsMismatch(f"weights out: reloaded logits differ ({'; '.join(lines)})") from None


class WeightsCase:
    """One model_type: saved once, the one-process reference run once, then any number of layouts."""

    def __init__(self, model_type: str, workdir: Path) -> None:
        self.model_type, self.workdir = model_type, workdir
        self.pretrained = workdir / "hf"
        hf = save_tiny_pretrained(model_type, self.pretrained)
        self.vocab_size = hf.config.get_text_config().vocab_size
        raw, ranks = pretrained_recipe_config(model_type, None, self.pretrained, workdir / "one")
        self.expected_loss = first_batch_loss(hf, raw)
        del hf
        self.ref_logits = reload_logits(
            train_from_pretrained(raw, ranks, self.expected_loss), self.vocab_size
        )

    def check(self, layout: str) -> None:
        """Weights in and out under `layout` (`WeightsMismatch`, `matrix.Refused` or a rank error)."""
        raw, ranks = pretrained_recipe_config(self.model_type, layout, self.pretrained, self.workdir / layout)
        consolidated = train_from_pretrained(raw, ranks, self.expected_loss)
        compare_logits(reload_logits(consolidated, self.vocab_size), self.ref_logits)
