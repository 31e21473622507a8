"""HF weights in and out per architecture: a model saved by transformers, loaded by the recipes into
a layout, gives transformers' own loss; the consolidated checkpoint written after training loads
back with ``from_pretrained`` to the same logits as the one-process run's checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from matrix import LAYOUTS, STEPS, recipe_config, run_case, tiny_model_config  # noqa: E402

RTOL = 1e-5

CASES = [
    ("gemma3_text", "pp2"),  # tied, scaled embedding, sliding layers
    ("gpt2", "pp2"),  # Conv1D projections, learned positions, tied
    ("qwen3_moe", "ep2"),  # stacked experts
]


def _first_batch_loss(model: torch.nn.Module, raw: dict) -> float:
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


@pytest.mark.parametrize(("model_type", "layout"), CASES)
def test_hf_weights_in_and_out(model_type: str, layout: str, tmp_path: Path) -> None:
    kwargs = tiny_model_config(model_type)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()

    def run(name: str, distributed: dict, ranks: int) -> list[dict[str, float]]:
        raw = recipe_config({"model_type": model_type}, distributed, str(tmp_path / name))
        raw["model"] = {"pretrained_path": str(tmp_path / "hf"), "dtype": "float32"}
        raw["checkpoint"] = {"enabled": True, "save_consolidated": True}
        metrics, _ = run_case(raw, ranks)
        expected = _first_batch_loss(hf, raw)
        assert abs(metrics[0]["loss"] - expected) <= RTOL * expected, (name, metrics[0]["loss"], expected)
        return metrics

    ranks, distributed = LAYOUTS[layout]
    run("one", {"strategy": "fsdp2"}, 1)
    run(layout, distributed, ranks)

    probe = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name in ("one", layout):
        saved = tmp_path / name / "checkpoints" / f"step_{STEPS}" / "consolidated"
        model = AutoModelForCausalLM.from_pretrained(saved).eval()
        with torch.no_grad():
            logits[name] = model(input_ids=probe).logits
    torch.testing.assert_close(logits[layout], logits["one"], rtol=RTOL, atol=RTOL)
