"""Hub ids resolved from the local HF cache only: a model (weights + tokenizer with its chat
template) and a dataset; an id that is not cached is a ConfigError naming the key, never a download."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from automodel.recipes import load_config
from automodel.recipes.cli import run_cli
from automodel.recipes.errors import ConfigError
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import TINY, preload, tiny_config, train_on_rank  # noqa: E402
from _sft_helpers import save_chat_tokenizer, write_arithmetic_jsonl  # noqa: E402

preload()

SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"


def _snapshot(cache: Path, kind: str, repo_id: str) -> Path:
    """The cache layout huggingface_hub writes: <kind>s--org--name/{refs/main, snapshots/<hash>/}."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    snap = repo / "snapshots" / SNAPSHOT
    snap.mkdir(parents=True)
    return snap


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cache = tmp_path / "hub"
    snap = _snapshot(cache, "model", "tiny-org/tiny-llama")
    hf_cfg = dict(TINY["model"]["config"])
    config = AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(config).save_pretrained(snap)
    save_chat_tokenizer(snap)
    data = _snapshot(cache, "dataset", "tiny-org/sums")
    (data / "data").mkdir()
    write_arithmetic_jsonl(data / "data" / "train.jsonl", n=64)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _config(out: Path, **model) -> dict:
    return tiny_config(
        str(out),
        model={"config": None, **model},
        validation_dataset=None,
        step_scheduler={
            "max_steps": 1,
            "val_every_steps": None,
            "global_batch_size": 4,
            "local_batch_size": 4,
        },
    )


def test_hub_id_from_cache_loads_weights_and_tokenizer(hub_cache: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from automodel.recipes.data import StatefulGlobalBatchSampler, build_packed_dataset, build_tokenizer

    snap = hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / SNAPSHOT
    raw = _config(tmp_path / "r", pretrained_model_name_or_path="tiny-org/tiny-llama")
    raw["dataset"] = {
        "source": "instruction",
        "path_or_dataset_id": "tiny-org/sums",  # a Hub dataset id, from the same cache
        "column_mapping": {"question": "q", "answer": "a"},
        "seq_length": 16,
    }
    cfg = load_config(raw)
    assert Path(cfg.model.pretrained_path) == snap and Path(cfg.tokenizer.path) == snap
    # the tokenizer came from the model's snapshot, with its chat template
    tok = build_tokenizer(cfg.tokenizer.path)
    assert tok.chat_template is not None
    ds = build_packed_dataset(cfg.dataset, tok, packed_sequence_size=0)
    sampler = StatefulGlobalBatchSampler(
        num_rows=len(ds), global_batch_size=4, local_batch_size=4, dp_rank=0, dp_size=1, seed=raw["seed"]
    )
    ids, labels, pos = ds.batch(sampler.next_step()[0])
    hf = AutoModelForCausalLM.from_pretrained(snap)
    with torch.no_grad():
        logits = hf(input_ids=ids, position_ids=pos, use_cache=False).logits
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100).item()
    # digits are not in the word-level vocabulary: every answer is <unk> <|end|>, but the loss is
    # still the pretrained model's own, on 1 process and on tp2 (weights loaded into the shards)
    (losses,) = run_on_ranks(train_on_rank, world_size=1, args=(raw,), timeout_s=300)
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses[0], expected)
    raw_tp = {**raw, "output_dir": str(tmp_path / "tp"), "distributed": {"strategy": "fsdp2", "tp_size": 2}}
    for rank_losses in run_on_ranks(train_on_rank, world_size=2, args=(raw_tp,), timeout_s=300):
        assert abs(rank_losses[0] - expected) <= 1e-5 * expected


def test_pretrained_path_alias_and_errors(hub_cache: Path, tmp_path: Path) -> None:
    snap = hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / SNAPSHOT
    cfg = load_config(_config(tmp_path / "a", pretrained_path="tiny-org/tiny-llama"))
    assert Path(cfg.model.pretrained_path) == snap
    cfg = load_config(_config(tmp_path / "b", pretrained_path=str(snap)))
    assert Path(cfg.model.pretrained_path) == snap
    # a tokenizer section naming a Hub id that is not cached is refused, naming its key
    raw = _config(tmp_path / "c", pretrained_model_name_or_path="tiny-org/tiny-llama")
    raw["tokenizer"] = {"pretrained_model_name_or_path": "tiny-org/not-cached"}
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    assert e.value.key == "tokenizer.pretrained_model_name_or_path"
    with pytest.raises(ConfigError) as e:
        load_config(_config(tmp_path / "d", pretrained_model_name_or_path="x", pretrained_path="y"))
    assert e.value.key == "model.pretrained_path"


@pytest.mark.parametrize(
    ("model", "key"),
    [
        ({"pretrained_model_name_or_path": "tiny-org/not-cached"}, "model.pretrained_model_name_or_path"),
        ({"pretrained_path": "tiny-org/not-cached"}, "model.pretrained_path"),
        ({"pretrained_model_name_or_path": "/no/such/dir"}, "model.pretrained_model_name_or_path"),
    ],
)
def test_uncached_hub_id_exits_2_before_launch(
    hub_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture, model: dict, key: str
) -> None:
    import yaml

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(_config(tmp_path / "out", **model)))
    assert run_cli(["train", str(path), "--nproc-per-node=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: {key}="), err
    assert "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out").exists()


def test_dataset_id_not_cached(hub_cache: Path, tmp_path: Path) -> None:
    from automodel.data.text_sections import SFTDatasetSection
    from automodel.recipes.data.kinds import check_paths as check_data_paths

    section = SFTDatasetSection(
        source="instruction",
        path_or_dataset_id="tiny-org/absent",
        column_mapping={"question": "q", "answer": "a"},
    )
    with pytest.raises(ConfigError) as e:
        check_data_paths(section)
    assert e.value.key == "dataset.path_or_dataset_id" and "not in the local Hugging Face cache" in str(
        e.value
    )
    assert json.loads(json.dumps(str(e.value)))  # one printable line
