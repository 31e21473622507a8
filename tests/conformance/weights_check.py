"""HF weights in and out, the check itself (used by `test_weights_in_out.py` and `weights_sweep.py`).

A tiny model of a registry model_type is saved with transformers' ``save_pretrained``; the recipes
load it (``model.pretrained_path``) into one process and into a layout and train two fp32 steps,
writing a consolidated checkpoint after the first. Weights in: the first step's loss equals
transformers' own loss of the saved model on the same batch (relative 1e-5). Weights out: the
step-1 consolidated checkpoint loads back with ``from_pretrained`` with no missing, unexpected or
mis-shaped keys, transformers' loss of the reload on the second batch equals the recipes' second
step loss (1e-5), every tensor's step-1 update equals one process's (to 1e-4 of its largest
update), and the layout's reload gives the one-process reload's logits (1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from matrix import LAYOUTS, recipe_config, run_case, tiny_model_config

RTOL = 1e-5
#: The checkpoint after step 1 holds trained (not initial) weights; step 2's loss is the recipes'
#: own forward of exactly those weights.
STEPS = 2


class WeightsMismatch(AssertionError):
    """Weights did not come in or go out as transformers has them (the message says which)."""


def save_tiny_pretrained(model_type: str, path: Path, *, seed: int = 1) -> Any:
    """Saves the tiny `model_type` with ``save_pretrained`` at `path`; the model reloaded from there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = tiny_model_config(model_type)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    if type(model.config) is not type(config):
        # The class keeps only its part of a composite config (Emu3ForCausalLM: Emu3TextConfig),
        # which AutoModelForCausalLM cannot map back; released checkpoints ship the whole config.
        config.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path).eval()


def batch_loss(model: torch.nn.Module, raw: dict[str, Any], step: int = 1) -> float:
    """transformers' own loss on the recipes' global batch of `step` (same data, sampler and seed)."""
    from automodel.data.text_sections import DatasetSection
    from automodel.recipes.data import ByteTokenizer, StatefulGlobalBatchSampler, build_packed_dataset

    ds = build_packed_dataset(DatasetSection(**raw["dataset"]), ByteTokenizer(), packed_sequence_size=0)
    gbs = raw["step_scheduler"]["global_batch_size"]
    sampler = StatefulGlobalBatchSampler(
        num_rows=len(ds), global_batch_size=gbs, local_batch_size=gbs, dp_rank=0, dp_size=1, seed=raw["seed"]
    )
    for _ in range(step):
        rows = sampler.next_step()[0]
    ids, labels, _ = ds.batch(rows)
    with torch.no_grad():
        return F.cross_entropy(
            model(input_ids=ids, use_cache=False).logits.flatten(0, 1), labels.flatten()
        ).item()


def pretrained_recipe_config(
    model_type: str, layout: str | None, pretrained: Path, output_dir: Path
) -> tuple[dict[str, Any], int]:
    """The recipe YAML (as a dict) loading `pretrained` into `layout` (None: one process), and its ranks."""
    ranks, distributed = LAYOUTS[layout] if layout else (1, {"strategy": "fsdp2"})
    raw = recipe_config({"model_type": model_type}, distributed, str(output_dir))
    raw["model"] = {"pretrained_path": str(pretrained), "dtype": "float32"}
    raw["step_scheduler"]["max_steps"] = STEPS
    raw["step_scheduler"]["ckpt_every_steps"] = 1
    raw["checkpoint"] = {"enabled": True, "save_consolidated": True}
    return raw, ranks


def _check_loss(what: str, got: float, expected: float) -> None:
    if not abs(got - expected) <= RTOL * abs(expected):
        rel = abs(got - expected) / abs(expected)
        raise WeightsMismatch(f"{what}: recipes {got:.8g}, transformers {expected:.8g} (rel {rel:.2e})")


def train_from_pretrained(raw: dict[str, Any], ranks: int, expected_loss: float) -> tuple[Path, float]:
    """Trains through the recipes' path: (step 1's consolidated checkpoint, step 2's loss).

    `matrix.Refused` when the recipes refuse the layout before launch, `WeightsMismatch` when the
    first step's loss is not transformers' `expected_loss`.
    """
    metrics, _ = run_case(raw, ranks)
    _check_loss("weights in: first loss", metrics[0]["loss"], expected_loss)
    return Path(raw["output_dir"]) / "checkpoints" / "step_1" / "consolidated", metrics[1]["loss"]


def reload(consolidated: Path) -> torch.nn.Module:
    """The ``from_pretrained`` reload of `consolidated`, in eval mode.

    `WeightsMismatch` when transformers reports missing, unexpected or mis-shaped keys (it would
    initialise those afresh and the logits could still agree by accident, e.g. norms of ones).
    """
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(consolidated, output_loading_info=True)  # pyright: ignore[reportGeneralTypeIssues]  # a (model, info) pair with output_loading_info
    bad = {k: sorted(v)[:4] for k, v in info.items() if k != "error_msgs" and v}
    if info.get("error_msgs"):
        bad["error_msgs"] = [str(e)[:200] for e in info["error_msgs"][:2]]
    if bad:
        raise WeightsMismatch(f"weights out: from_pretrained of the consolidated checkpoint reports {bad}")
    return model.eval()


def probe_logits(model: torch.nn.Module, vocab_size: int) -> torch.Tensor:
    """`model`'s logits on a fixed probe batch."""
    probe = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=probe, use_cache=False).logits


#: A layout's step-1 update of each tensor must equal one process's to this fraction of the
#: tensor's largest update (fp32 rounding of the gradients is ~1e-6 of it; a wrong gradient, e.g.
#: summed twice, is of its order), plus fractions of the tensor's largest weight and of the largest
#: update in the whole model (a gradient that is zero in exact arithmetic, an attention key bias's,
#: is rounding noise of that scale and differs between layouts by its own size).
UPDATE_RTOL, WEIGHT_RTOL, MODEL_UPDATE_RTOL = 1e-4, 1e-6, 1e-7


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in `directory`, by checkpoint key."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def compare_updates(
    got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], initial: dict[str, torch.Tensor]
) -> None:
    """`WeightsMismatch` unless every tensor's step-1 update under the layout is one process's.

    Catches a wrong gradient in a parameter too small to move the loss or the gradient norm past
    their tolerance (a per-head norm's gradient summed twice over tp moved the logits by 3e-5)."""
    updates = {
        key: float((want.float() - initial[key].float()).abs().max()) if want.numel() else 0.0
        for key, want in ref.items()
        if key in initial  # else a tied copy save_pretrained leaves out (its source is compared)
    }
    floor = MODEL_UPDATE_RTOL * max(updates.values(), default=0.0)
    bad = []
    for key, update in updates.items():
        want = ref[key]
        diff = float((got[key].float() - want.float()).abs().max()) if want.numel() else 0.0
        allowed = (
            UPDATE_RTOL * update + WEIGHT_RTOL * (float(want.abs().max()) if want.numel() else 0.0) + floor
        )
        if diff > allowed:
            bad.append(f"{key} (differs by {diff:.2e}, one-process update {update:.2e})")
    if bad:
        raise WeightsMismatch(f"weights out: step-1 updates differ from one process: {'; '.join(bad[:4])}")


def reload_logits(consolidated: Path, vocab_size: int) -> torch.Tensor:
    """Probe logits of the checked ``from_pretrained`` reload of `consolidated`."""
    return probe_logits(reload(consolidated), vocab_size)


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
        self.raw = raw
        self.expected_loss = batch_loss(hf, raw)
        del hf
        consolidated, second_loss = train_from_pretrained(raw, ranks, self.expected_loss)
        self.ref_logits = self._out(consolidated, second_loss)
        self.ref_weights = checkpoint_tensors(consolidated)
        self.initial_weights = checkpoint_tensors(self.pretrained)

    def _out(self, consolidated: Path, second_loss: float) -> torch.Tensor:
        model = reload(consolidated)
        _check_loss("weights out: second loss", second_loss, batch_loss(model, self.raw, step=2))
        return probe_logits(model, self.vocab_size)

    def check(self, layout: str) -> None:
        """Weights in and out under `layout` (`WeightsMismatch`, `matrix.Refused` or a rank error)."""
        raw, ranks = pretrained_recipe_config(self.model_type, layout, self.pretrained, self.workdir / layout)
        consolidated, second_loss = train_from_pretrained(raw, ranks, self.expected_loss)
        logits = self._out(consolidated, second_loss)
        compare_updates(checkpoint_tensors(consolidated), self.ref_weights, self.initial_weights)
        compare_logits(logits, self.ref_logits)
