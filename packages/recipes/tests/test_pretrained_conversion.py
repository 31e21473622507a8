"""Pretrained checkpoints load through transformers' own conversion mapping, into any layout.

transformers' ``save_pretrained`` writes Mixtral's experts one tensor each (``w1``/``w3``/``w2``) and
GPT-NeoX's head as ``embed_out``; the models hold stacked experts and ``lm_head``. Loading into
sharded parameters must give exactly ``from_pretrained``'s weights, read only the experts a rank
holds when the layout splits whole experts, and keep working when FSDP2 swaps the model's class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Shard
from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig, MixtralConfig

from automodel.recipes.checkpoint.converted_weights import SafetensorsReader
from automodel.recipes.checkpoint.key_mapping import find_hf_model, plan_keys
from automodel.testing.ranks import run_on_ranks

EXPERTS = 4


def _config(kind: str) -> Any:
    common = dict(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    if kind == "mixtral":
        return MixtralConfig(num_local_experts=EXPERTS, num_experts_per_tok=2, **common)
    if kind == "llama_tied":  # save_pretrained writes the tied head once, under the embedding's name
        return LlamaConfig(**{**common, "tie_word_embeddings": True})
    return GPTNeoXConfig(**common)


def _model(kind: str, seed: int) -> Any:
    """A causal LM of family `kind` (Any: the tests reach family-specific children)."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(kind))


def _save(kind: str, directory: Path) -> dict[str, torch.Tensor]:
    _model(kind, seed=5).save_pretrained(directory)
    reference = AutoModelForCausalLM.from_pretrained(directory)
    return {k: v.detach().clone() for k, v in reference.state_dict().items()}


def _checkpoint_keys(directory: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("kind", ["mixtral", "gpt_neox"])
def test_plan_covers_every_parameter_only_with_the_mapping(tmp_path: Path, kind: str) -> None:
    _save(kind, tmp_path)
    checkpoint_keys = _checkpoint_keys(tmp_path)
    model = _model(kind, seed=0)
    model_keys = set(model.state_dict())
    assert checkpoint_keys != model_keys  # the checkpoint layout differs from the model's
    plan = plan_keys(find_hf_model([model]), model_keys, checkpoint_keys)
    assert plan.covered() == model_keys
    assert plan_keys(None, model_keys, checkpoint_keys).covered() < model_keys
    if kind == "gpt_neox":  # a rename only
        assert plan.renamed["lm_head.weight"] == "embed_out.weight" and not plan.converted
    else:  # w1 and w3 of every expert make one stacked tensor
        gate_up = next(
            g for g in plan.converted if g.first_target == "model.layers.0.mlp.experts.gate_up_proj"
        )
        assert [len(keys) for keys in gate_up.sources.values()] == [EXPERTS, EXPERTS]


def _load_on_rank(kind: str, layout: str, directory: str, export: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from automodel.recipes.checkpoint import load_pretrained_weights

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(kind, seed=100 + dist.get_rank())  # every weight must come from the files
    if layout == "fsdp":  # Shard(0): a rank holds whole experts
        for layer in model.gpt_neox.layers if kind == "gpt_neox" else model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:  # "columns": experts split along their rows (as tensor parallelism splits them)
        for layer in model.model.layers:
            experts = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(experts, name)
                setattr(experts, name, nn.Parameter(distribute_tensor(full.detach(), mesh, [Shard(1)])))
    read: list[str] = []
    original = SafetensorsReader.__call__

    def recording(self: SafetensorsReader, key: str) -> torch.Tensor:
        read.append(key)
        return original(self, key)

    with mock.patch.object(SafetensorsReader, "__call__", recording):
        load_pretrained_weights([model], directory)
    from automodel.recipes.checkpoint.consolidated import save_consolidated
    from automodel.recipes.strategies.base import PLAIN_PARTS

    Path(export).mkdir(exist_ok=True)
    save_consolidated(
        model_parts=[model], directory=Path(export), model_save_format="safetensors", strategy=PLAIN_PARTS
    )
    params = {}
    for name, tensor in model.state_dict().items():
        params[name] = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return {"params": params, "read": read, "placements": placements}


@pytest.mark.parametrize(
    ("kind", "layout"),
    [("mixtral", "fsdp"), ("mixtral", "columns"), ("gpt_neox", "fsdp"), ("llama_tied", "fsdp")],
)
def test_sharded_load_equals_from_pretrained(tmp_path: Path, kind: str, layout: str) -> None:
    expected = _save(kind, tmp_path / "hf")
    export = tmp_path / "consolidated"
    results = run_on_ranks(
        _load_on_rank, world_size=2, args=(kind, layout, str(tmp_path / "hf"), str(export)), timeout_s=300
    )
    # the export is what save_pretrained wrote: same keys (checkpoint layout), same tensors
    from safetensors.torch import load_file

    written = {}
    for path in sorted(export.glob("*.safetensors")):
        written.update(load_file(str(path)))
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert written.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(written[key], value), key
    for rank, result in enumerate(results):
        assert result["params"].keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(result["params"][name], value), (rank, name)
        sharded = result["placements"]
        if kind != "mixtral":  # renamed (GPT-NeoX's embed_out) or tied to the embedding: read by DCP
            assert "model.embed_tokens.weight" in sharded or "lm_head.weight" in sharded
            assert not result["read"]
            continue
        gate_up = sharded["model.layers.0.mlp.experts.gate_up_proj"]
        assert gate_up == ((Shard(0 if layout == "fsdp" else 1),))
        per_expert = {k.split(".experts.")[1].split(".")[0] for k in result["read"] if ".experts." in k}
        # whole experts per rank: only its own are read; split experts: every expert is needed
        owned = {str(e) for e in range(EXPERTS) if e // (EXPERTS // 2) == rank}
        assert per_expert == (owned if layout == "fsdp" else {str(e) for e in range(EXPERTS)}), rank


def test_tied_weight_saved_under_a_later_name(tmp_path: Path) -> None:
    """CamemBERT registers the head (``lm_head.decoder.weight``) before the embedding it is tied to;
    ``save_pretrained`` keeps the embedding's name. The tie supplies the head."""
    from transformers import CamembertConfig

    from automodel.recipes.checkpoint import load_pretrained_weights

    config = CamembertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=64,
        is_decoder=True,
    )
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert "lm_head.decoder.weight" not in _checkpoint_keys(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert names.index("lm_head.decoder.weight") < names.index("roberta.embeddings.word_embeddings.weight")
    load_pretrained_weights([model], tmp_path)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_sharded_bf16_hub_layout_loads_like_from_pretrained(tmp_path: Path) -> None:
    """A Hub-style checkpoint: bf16 tensors in several safetensors files with an index, per-expert
    tensors spread over the files; loaded into an fp32 model as ``from_pretrained`` loads it."""
    from automodel.recipes.checkpoint import load_pretrained_weights

    source = _model("mixtral", seed=5).to(torch.bfloat16)
    source.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (
        len(list(tmp_path.glob("*.safetensors"))) > 2
        and (tmp_path / "model.safetensors.index.json").is_file()
    )
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    model = _model("mixtral", seed=100)
    load_pretrained_weights([model], tmp_path)
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, expected[name]), name
