"""NeMo AutoModel's recipe keys load here (tests/data/automodel_keys.json, recorded from its 220
example recipes by scripts/automodel_compat.py), and configs written in its shapes train.

Each recorded key path is set, with each value that occurs, on a small AutoModel-shaped config:
it must load, or be refused naming that key (`REFUSED`: AutoModel features this project does not
have) either when parsed or by `recipes train` before launch.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from automodel.recipes.api import load_config
from automodel.recipes.errors import ConfigError
from automodel.testing.tiny_model import TINY_SIZES

KEYS = json.loads((Path(__file__).parent / "data" / "automodel_keys.json").read_text())["keys"]

#: key-path prefixes AutoModel has and this project refuses (each by name), and why
REFUSED = {
    "skypilot": "SkyPilot launcher",
    "benchmark": "benchmark recipe",
    "tool_call_eval": "tool-call evaluator",
    "quantization": "QLoRA (launch refusal)",
    "qat": "QAT (launch refusal)",
    "neftune": "NEFTune (launch refusal)",
    "model.backend.te_fp8": "FP8 (launch refusal)",
    "model.backend.fake_balanced_gate": "benchmark gate (launch refusal)",
    "model.num_nextn_predict_layers": "multi-token prediction (launch refusal)",
    "embedding_row_repair": "not implemented (launch refusal)",
    "peft.moe_rank_scaling": "LoRA on MoE experts (launch refusal)",
    "model.n_": "gpt2 builder keys, checked with its _target_",
    "model.config.kda_": "Kimi linear attention options",
    "model.bos_token_id": "gpt2 builder keys",
    "model.eos_token_id": "gpt2 builder keys",
    "model.vocab_size": "gpt2 builder keys",
    "model._target_": "Seq2Seq / unknown builders",
    "optimizer._target_": "optimizers that cannot be imported here (flashoptim, dion)",
    "optimizer.": "options of those optimizers",
    "dataloader.collate_fn": "prefix-tree collate",
    "dataset.": "dataset factories not read here (agent chat, xlam, mock, seq2seq) and their keys",
    "validation_dataset.": "likewise",
    "distributed.dp_replicate_size": "needs a matching layout",
}
#: (key path, value) pairs that load and are refused before launch although other values of the
#: key are not (none today: transformer-engine's kernel keys run as the model's own modules)
REFUSED_VALUES: set[tuple[str, str]] = set()


def _model_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"model_type": "llama", **TINY_SIZES}))
    return root


#: the smallest section of each dataset class this project reads (the test sets one key on it)
DATASETS = {
    "make_squad_dataset": {"dataset_name": "squad.jsonl"},
    "HellaSwag": {"path_or_dataset": "hellaswag.jsonl"},
    "ColumnMappedTextInstructionDataset": {
        "path_or_dataset_id": "rows.jsonl",
        "column_mapping": {"question": "prompt", "answer": "completion"},
    },
    "ChatDataset": {"path_or_dataset_id": "chat.jsonl"},
    "MegatronPretraining": {"paths": "corpus", "seq_length": 32},
    "NanogptDataset": {"file_pattern": "shard_*.bin", "seq_len": 32},
}
PREFIX = "nemo_automodel.components.datasets.llm."
MODULES = {
    "make_squad_dataset": "squad",
    "HellaSwag": "hellaswag",
    "ColumnMappedTextInstructionDataset": "column_mapped_text_instruction_dataset",
    "ChatDataset": "chat_dataset",
    "MegatronPretraining": "megatron_dataset",
    "NanogptDataset": "nanogpt_dataset",
}


def automodel_base(model_dir: str) -> dict[str, Any]:
    """A small config in AutoModel's own shape (keys as its example recipes write them)."""
    return {
        "recipe": "TrainFinetuneRecipeForNextTokenPrediction",
        "step_scheduler": {
            "global_batch_size": 8,
            "local_batch_size": 2,
            "max_steps": 6,
            "ckpt_every_steps": 50,
        },
        "dist_env": {"backend": "gloo", "timeout_minutes": 1},
        "rng": {
            "_target_": "nemo_automodel.components.training.rng.StatefulRNG",
            "seed": 1111,
            "ranked": True,
        },
        "model": {
            "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_pretrained",
            "pretrained_model_name_or_path": model_dir,
            "torch_dtype": "float32",
        },
        "checkpoint": {"enabled": False},
        "distributed": {
            "strategy": "fsdp2",
            "dp_size": "none",
            "tp_size": 1,
            "cp_size": 1,
            "sequence_parallel": False,
        },
        "loss_fn": {"_target_": "nemo_automodel.components.loss.masked_ce.MaskedCrossEntropy"},
        "dataset": {
            "_target_": PREFIX + "squad.make_squad_dataset",
            "dataset_name": "squad.jsonl",
            "split": "train",
        },
        "packed_sequence": {"packed_sequence_size": 0},
        "dataloader": {
            "_target_": "torchdata.stateful_dataloader.StatefulDataLoader",
            "collate_fn": "nemo_automodel.components.datasets.utils.default_collater",
            "shuffle": True,
        },
        "optimizer": {
            "_target_": "torch.optim.Adam",
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "lr": 3.0e-3,
            "weight_decay": 0,
        },
        "logging": {"progress_bar": False},
    }


def _set(node: dict, path: list[str], value: Any) -> None:
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[path[-1]] = value


def _dataset_for(cfg: dict, section: str, targets: list[str]) -> bool:
    """Give `section` the first dataset class of `targets` read here; False if there is none."""
    known = [t for t in targets if t in DATASETS]
    if not known:
        return False
    cfg[section] = {
        "_target_": f"{PREFIX}{MODULES[known[0]]}.{known[0]}",
        **copy.deepcopy(DATASETS[known[0]]),
    }
    return True


def config_with(path: str, value: Any, facts: dict, model_dir: str) -> dict:
    """The base config with `path` set to `value`, in the context that key lives in."""
    cfg = automodel_base(model_dir)
    parts = path.split(".")
    if parts[-1] == "pretrained_model_name_or_path" and isinstance(value, str):
        value = model_dir  # "only the model id pointed at a local directory"
    section = parts[0]
    if section in ("dataset", "validation_dataset") and not _dataset_for(
        cfg, section, facts.get("dataset_targets", [])
    ):
        cfg[section] = {}
    if path.startswith("distributed.pipeline."):
        cfg["distributed"].update(pp_size=2, pipeline={"pp_microbatch_size": 1})
    if path.startswith("distributed.moe."):
        cfg["distributed"]["ep_size"] = 2
    if path.startswith("model.config.") and path != "model.config._target_":
        cfg["model"] = {
            "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
            "config": {
                "_target_": "transformers.AutoConfig.from_pretrained",
                "pretrained_model_name_or_path": model_dir,
            },
        }
    if path == "model.config._target_":
        cfg["model"] = {"_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config", "config": {}}
        if not str(value).endswith(".from_pretrained"):
            cfg["model"]["config"]["model_type"] = "llama"
        else:
            cfg["model"]["config"]["pretrained_model_name_or_path"] = model_dir
    if path.startswith("model.backend.") and path != "model.backend._target_":
        cfg["model"]["backend"] = {"_target_": "nemo_automodel.components.models.common.BackendConfig"}
    if path.startswith("peft.") and path != "peft._target_":
        cfg["peft"] = {"_target_": "nemo_automodel.components._peft.lora.PeftConfig"}
    if path.startswith("validation_dataloader") or path.startswith("validation_dataset"):
        cfg.setdefault(
            "validation_dataset",
            {"_target_": PREFIX + "squad.make_squad_dataset", "dataset_name": "squad.jsonl"},
        )
    if path == "validation_dataset._target_" and str(value).rsplit(".", 1)[-1] in DATASETS:
        cfg["validation_dataset"] = copy.deepcopy(DATASETS[str(value).rsplit(".", 1)[-1]])
    if path == "dataset._target_" and str(value).rsplit(".", 1)[-1] in DATASETS:
        cfg["dataset"] = copy.deepcopy(DATASETS[str(value).rsplit(".", 1)[-1]])
    if path.startswith("tokenizer.") and path != "tokenizer._target_":
        cfg["tokenizer"] = {"_target_": "nemo_automodel.NeMoAutoTokenizer.from_pretrained"}
    if section == "wandb":
        cfg["wandb"] = {"enable": False}  # as in every recorded file
    if path.endswith("collate_fn.pad_seq_len_divisible"):
        _set(
            cfg,
            [section, "collate_fn"],
            {"_target_": "nemo_automodel.components.datasets.utils.default_collater"},
        )
    if path == "seed":
        del cfg["rng"]["seed"]
    if isinstance(value, dict) and not value and section in cfg and len(parts) == 1:
        return cfg
    _set(cfg, parts, value)
    steps = cfg["step_scheduler"]
    if path in ("step_scheduler.local_batch_size", "dataloader.batch_size") and isinstance(value, int):
        steps.update(local_batch_size=value, global_batch_size=4 * value)
    if path == "step_scheduler.global_batch_size" and isinstance(value, int):
        steps["local_batch_size"] = 1
    if path == "distributed.pipeline.pp_microbatch_size" and isinstance(value, int):
        steps.update(local_batch_size=value, global_batch_size=4 * value)
    if path == "distributed.pp_size" and value != 1:
        cfg["distributed"]["pipeline"] = {"pp_microbatch_size": 1}
    if path == "packed_sequence.max_packs":
        cfg["packed_sequence"]["packed_sequence_size"] = 64
    if path == "packed_sequence.packed_sequence_size" and isinstance(value, int) and value > 0:
        cfg["step_scheduler"]["local_batch_size"] = 1
    return cfg


def _refused_prefix(path: str) -> str | None:
    return next(
        (p for p in REFUSED if path == p or path.startswith(p if p.endswith((".", "_")) else p + ".")), None
    )


CASES = [(path, i) for path, facts in KEYS.items() for i in range(len(facts["values"]))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(_model_dir(tmp_path_factory.mktemp("automodel") / "tiny-llama"))


def test_every_recorded_key_path_loads_or_is_refused_by_name(model_dir: str) -> None:
    """All recorded (key path, value) pairs in one test: ~900 parses, under a few seconds."""
    import warnings

    failures = []
    loaded = refused = 0
    for path, i in CASES:
        facts = KEYS[path]
        value = facts["values"][i]
        raw = config_with(path, value, facts, model_dir)
        raw["output_dir"] = "/tmp/unused"
        expected = _refused_prefix(path)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cfg = load_config(raw)
        except ConfigError as e:
            if expected is None:
                failures.append(f"{path}={value!r}: refused: {e}")
            elif not (e.key.startswith(path.split(".")[0]) or path.startswith(e.key)):
                failures.append(f"{path}={value!r}: refused naming another key: {e}")
            refused += 1
            continue
        loaded += 1
        by_value = (path, value) in REFUSED_VALUES if isinstance(value, str) else False
        if cfg.refusals and expected is None and not by_value:
            failures.append(f"{path}={value!r}: refused before launch: {cfg.refusals[0]}")
        if by_value and not any(r.key == path for r in cfg.refusals):
            failures.append(f"{path}={value!r}: not refused before launch")
        if expected is not None and cfg.refusals:
            assert any(
                path.startswith(r.key.split("[")[0].rsplit(".", 0)[0]) or r.key.startswith(path.split(".")[0])
                for r in cfg.refusals
            )
    assert not failures, f"{len(failures)} of {len(CASES)}:\n" + "\n".join(failures[:60])
    assert loaded > 0.85 * len(CASES), (loaded, refused)


def test_automodel_numbers_and_defaults(model_dir: str) -> None:
    """1e-8 is a number in files and overrides; AutoModel's defaults where keys are absent."""
    from automodel.recipes.loader import load_yaml
    from automodel.recipes.lr_schedule import schedule_values

    raw = load_yaml("optimizer: {_target_: torch.optim.Adam, eps: 1e-8, lr: 1e-5}\n")
    assert raw["optimizer"] == {"_target_": "torch.optim.Adam", "eps": 1e-8, "lr": 1e-5}
    base = automodel_base(model_dir)
    base["output_dir"] = "/tmp/unused"
    cfg = load_config(base, overrides=["--optimizer.lr=1e-4", "--model.torch_dtype=bf16"])
    assert cfg.optimizer.kwargs["lr"] == 1e-4 and cfg.model.dtype == "bfloat16"
    assert cfg.lr_scheduler.decay_style == "constant"  # no lr_scheduler section: constant, as AutoModel
    assert cfg.dataloader.shuffle and cfg.rng.ranked and cfg.seed == 1111
    cfg = load_config({**base, "lr_scheduler": {"lr_decay_style": "cosine"}})
    values = schedule_values(cfg.lr_scheduler, base_lr=1e-4, total_steps=50)
    assert values["warmup_steps"] == 5 and values["min_ratio"] == pytest.approx(0.01)
    assert values["init_ratio"] == pytest.approx(0.1)
    # AutoModel ignores these when checkpointing / validation is off: a start-up line here, not an error
    assert any(line.startswith("step_scheduler.ckpt_every_steps=50 has no effect") for line in cfg.notes)
    steps = {**base["step_scheduler"], "val_every_steps": 10}
    assert any(
        "val_every_steps=10 has no effect" in n for n in load_config({**base, "step_scheduler": steps}).notes
    )
    bare = load_config({k: v for k, v in base.items() if k not in ("dataloader", "checkpoint")})
    assert bare.dataloader.shuffle is True  # AutoModel's default with no dataloader section
    assert any(n.startswith("checkpoint: no section, so no checkpoints are written") for n in bare.notes)
    shuffled = load_config({**base, "dataloader": {**base["dataloader"], "shuffle": False}})
    assert shuffled.dataloader.shuffle is False
    with pytest.raises(ConfigError, match="distributed.backend"):
        load_config({**base, "distributed": {**base["distributed"], "backend": "nccl"}})  # dist_env says gloo
    moved = load_config({**base, "dist_env": {}, "distributed": {**base["distributed"], "backend": "gloo"}})
    assert moved.dist_env.backend == "gloo"
    with pytest.raises(ConfigError, match="model._target_"):
        load_config(
            {
                **base,
                "model": {
                    **base["model"],
                    "_target_": "nemo_automodel.NeMoAutoModelForSeq2SeqLM.from_pretrained",
                },
            }
        )


def test_train_refuses_unimplemented_features_before_launch(model_dir: str) -> None:
    from automodel.recipes.environment import check_environment

    base = automodel_base(model_dir)
    base["output_dir"] = "/tmp/unused"
    cfg = load_config({**base, "qat": {"enabled": True}})
    with pytest.raises(ConfigError, match=r"^qat=.*quantization-aware training is not implemented"):
        check_environment(cfg)
    # kernels of other libraries, same math: one start-up line; torch's own: no line at all
    backend = {"_target_": "nemo_automodel.components.models.common.BackendConfig"}
    cfg = load_config({**base, "model": {**base["model"], "backend": {**backend, "experts": "gmm"}}})
    assert any(line.startswith("model.backend: experts=gmm") for line in cfg.notes)
    check_environment(cfg)
    same = {"attn": "sdpa", "linear": "torch", "rms_norm": "torch_fp32", "experts": "torch"}
    cfg = load_config({**base, "model": {**base["model"], "backend": {**backend, **same}}})
    assert not [line for line in cfg.notes if "backend" in line] and not cfg.refusals
    # AutoModel's kda_mode is a config field (from_pretrained hands it on): checked when the model is built
    kda = load_config({**base, "model": {**base["model"], "kda_mode": "chunk"}})
    assert kda.model.config_overrides == {"kda_mode": "chunk"}
    # prewarm only tunes kernels: a line; embedding_row_repair changes weights: refused before launch
    cfg = load_config(
        {**base, "prewarm": {"mamba_ssd_autotune": True}, "embedding_row_repair": {"min_norm": 1e-4}}
    )
    assert any(line.startswith("prewarm: ") for line in cfg.notes)
    with pytest.raises(ConfigError, match=r"^embedding_row_repair="):
        check_environment(cfg)
    assert load_config({**base, "embedding_row_repair": {"enabled": False}}).refusals == ()


def test_keys_that_mean_the_same_are_silent_and_validate_checks_the_optimizer(
    tmp_path: Path, model_dir: str, capsys: pytest.CaptureFixture
) -> None:
    """AutoModel's keys that mean what they mean here add no start-up line (only real differences do);
    `recipes validate` builds the optimizer with its arguments, as train would (exit 2 naming the key)."""
    import yaml

    from automodel.recipes.cli import run_cli

    raw = automodel_base(model_dir)
    raw["output_dir"] = str(tmp_path / "run")
    raw.update(
        ci={"recipe_owner": "someone", "time": "00:10:00"},
        compile={"enabled": False, "mode": "default", "fullgraph": False, "dynamic": True, "backend": None},
        wandb={"enable": False, "project": "p"},
        dataset={**raw["dataset"], "seq_length": 64, "answer_only_loss_mask": False},
        step_scheduler={k: v for k, v in raw["step_scheduler"].items() if k != "ckpt_every_steps"},
        seed=1111,  # AutoModel's own seed (it ignores rng.seed)
    )
    raw["distributed"]["mp_policy"] = {"param_dtype": "float32"}  # AutoModel's default is bf16
    raw["model"]["backend"] = {
        "_target_": "nemo_automodel.components.models.common.BackendConfig",
        "attn": "sdpa", "linear": "torch", "rms_norm": "torch_fp32", "rope_fusion": False,
        "enable_hf_state_dict_adapter": True, "fake_balanced_gate": False,
    }  # fmt: skip
    cfg = load_config(copy.deepcopy(raw))
    assert cfg.notes == () and cfg.refusals == (), cfg.notes
    raw["optimizer"]["adam_w_mode"] = True  # a FusedAdam argument left on torch's Adam
    path = tmp_path / "adam.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert run_cli(["validate", str(path)]) == 2
    assert capsys.readouterr().err.startswith("error: optimizer.adam_w_mode=True: is not an argument of Adam")


def test_transformer_engine_backend_runs_the_models_own_modules(
    tmp_path: Path, model_dir: str, capsys: pytest.CaptureFixture
) -> None:
    """``te`` kernels compute the same math as the transformers model's own modules, which run here
    (as for ``gmm`` / ``deepep``): the file loads to the same run as without the keys, with one
    start-up line saying TE's kernels are not used, and `recipes validate` exits 0. A TE FP8 recipe
    (``te_fp8``) changes the math and is still refused before launch."""
    import dataclasses

    import yaml

    from automodel.recipes.cli import run_cli

    raw = automodel_base(model_dir)
    raw["output_dir"] = str(tmp_path / "run")
    raw["dataset"]["dataset_name"] = str(tmp_path / "squad.jsonl")
    row = json.dumps({"context": "c", "question": "q", "answers": {"text": ["a"], "answer_start": [0]}})
    # a global batch of rows: `recipes validate` counts them (fewer is refused before launch)
    (tmp_path / "squad.jsonl").write_text((row + "\n") * raw["step_scheduler"]["global_batch_size"])
    plain = load_config(copy.deepcopy(raw))
    raw["model"]["backend"] = {"attn": "te", "linear": "te", "rms_norm": "torch_fp32", "experts": "te"}
    cfg = load_config(copy.deepcopy(raw))
    assert not cfg.refusals
    lines = [n for n in cfg.notes if n.startswith("model.backend")]
    assert lines == [
        "model.backend: attn=te, linear=te, experts=te: transformer-engine's kernels are not used; the "
        "transformers model's own modules run as attn=sdpa, linear=torch, experts=torch (same math)"
    ]
    same = {"notes": (), "raw": {}}  # the file as written and its lines differ; the run does not
    assert dataclasses.replace(cfg, **same) == dataclasses.replace(plain, **same)
    path = tmp_path / "te.yaml"
    path.write_text(yaml.safe_dump(raw))
    capsys.readouterr()
    assert run_cli(["validate", str(path)]) == 0
    assert "transformer-engine's kernels are not used" in "".join(capsys.readouterr())
    raw["model"]["backend"]["te_fp8"] = {"recipe": "current"}
    assert [(e.key, "FP8" in e.message) for e in load_config(copy.deepcopy(raw)).refusals] == [
        ("model.backend.te_fp8", True)
    ]


def test_pretrained_config_overrides(model_dir: str) -> None:
    """AutoModel's ``config: {_target_: AutoConfig.from_pretrained, <same checkpoint>, k: v}`` next to
    ``pretrained_model_name_or_path``: the checkpoint's config with those fields set, each checked."""
    from automodel.recipes.model import build_hf_config

    raw = automodel_base(model_dir)
    raw["output_dir"] = "/tmp/unused"
    raw["model"]["config"] = {
        "_target_": "transformers.AutoConfig.from_pretrained",
        "pretrained_model_name_or_path": model_dir,
        "max_position_embeddings": 96,
        "_attn_implementation": "eager",
    }
    cfg = load_config(copy.deepcopy(raw))
    assert cfg.model.config_overrides == {"max_position_embeddings": 96}
    assert cfg.model.attn_implementation == "eager"
    hf = build_hf_config(cfg.model)
    assert hf.max_position_embeddings == 96 and hf.hidden_size == 64
    raw["model"]["config"]["max_position_embedding"] = 96  # a typo: refused by name, not kept unused
    with pytest.raises(ConfigError, match=r"model\.config_overrides\.max_position_embedding\b"):
        build_hf_config(load_config(copy.deepcopy(raw)).model)
    raw["model"]["config"]["pretrained_model_name_or_path"] = "/elsewhere"
    with pytest.raises(ConfigError, match=r"model\.config\.pretrained_model_name_or_path"):
        load_config(raw)


def test_tokenizer_add_bos_token_is_set_and_checked(tmp_path: Path, model_dir: str) -> None:
    """``tokenizer.add_bos_token`` reaches the HF tokenizer and is checked after loading; a tokenizer
    that ignores it, or the byte tokenizer, is refused by name; ``add_eos_token: false`` too."""
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaTokenizerFast

    from automodel.data.tokenizer import build_tokenizer

    vocab = {t: i for i, t in enumerate(["<unk>", "<s>", "</s>", "a", "b"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    llama = tmp_path / "llama_tok"
    LlamaTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", add_bos_token=False
    ).save_pretrained(str(llama))
    assert not build_tokenizer(str(llama)).prepends_bos()
    on = build_tokenizer(str(llama), add_bos_token=True)
    assert on.prepends_bos() and on.bos_token_id == 1
    assert not build_tokenizer(str(llama), add_bos_token=False).prepends_bos()
    # one rule (data.tokenizer.bos_prefix) for every place that writes BOS: SFT rows, shards, prompts
    from automodel.data.sft import ExampleEncoder
    from automodel.data.text_sections import SFTDatasetSection
    from automodel.data.tokenizer import bos_prefix
    from automodel.recipes.generate import prompt_ids

    off = build_tokenizer(str(llama))
    assert bos_prefix(on) == [1] and bos_prefix(off) == [] and bos_prefix(build_tokenizer(None)) == []
    assert prompt_ids(on, "a")[0] == 1 and prompt_ids(off, "a")[0] != 1
    row = {"question": "a", "answer": "b"}
    mapping = {"question": "question", "answer": "answer"}
    section = SFTDatasetSection(path_or_dataset_id="rows.jsonl", column_mapping=mapping)
    assert ExampleEncoder(section, on)(row).ids[0] == 1
    assert ExampleEncoder(section, off)(row).ids[0] != 1

    sys.path.insert(0, str(Path(__file__).parent))
    from _sft_helpers import save_chat_tokenizer

    save_chat_tokenizer(tmp_path / "no_bos")
    with pytest.raises(ConfigError, match=r"tokenizer\.add_bos_token=True: is not honoured"):
        build_tokenizer(str(tmp_path / "no_bos"), add_bos_token=True)
    with pytest.raises(ConfigError, match=r"tokenizer\.add_bos_token=True: the byte tokenizer"):
        build_tokenizer(None, add_bos_token=True)
    raw = automodel_base(model_dir)
    raw["output_dir"] = "/tmp/unused"
    raw["tokenizer"] = {
        "pretrained_model_name_or_path": str(llama),
        "add_bos_token": True,
        "add_eos_token": True,
    }
    assert load_config(copy.deepcopy(raw)).tokenizer.add_bos_token is True
    raw["tokenizer"]["add_eos_token"] = False
    with pytest.raises(ConfigError, match=r"tokenizer\.add_eos_token=False"):
        load_config(raw)


def test_fused_adam_master_weights_of_bf16_parameters(model_dir: str) -> None:
    """TE FusedAdam with ``master_weights: true`` over bf16 parameters that the file's mp_policy
    computes in bf16 (AutoModel's llama_3_3_70b_instruct_squad, llama3_70b_pretrain): the same update
    as a float32 model (the masters) computing in bf16, with a line; without such an mp_policy the
    masters are still refused naming the key."""
    raw = automodel_base(model_dir)
    raw["output_dir"] = "/tmp/unused"
    raw["model"]["torch_dtype"] = "bfloat16"
    raw["optimizer"] = {
        "_target_": "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam", "lr": 1.0e-5,
        "adam_w_mode": True, "master_weights": True, "store_param_remainders": True,
        "exp_avg_dtype": "torch.float32", "exp_avg_sq_dtype": "torch.float32",
    }  # fmt: skip
    refused = load_config(copy.deepcopy(raw))
    assert [e.key for e in refused.refusals] == [
        "optimizer.exp_avg_dtype",
        "optimizer.exp_avg_sq_dtype",
        "optimizer.master_weights",
    ]
    raw["distributed"]["mp_policy"] = {
        "_target_": "torch.distributed.fsdp.MixedPrecisionPolicy",
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
    }
    cfg = load_config(copy.deepcopy(raw))
    assert not cfg.refusals
    assert str(cfg.model.dtype) in ("float32", "torch.float32")
    assert cfg.distributed.strategy_config.compute_dtype == torch.bfloat16
    assert any(n.startswith("optimizer.master_weights: true with model.torch_dtype") for n in cfg.notes)


def _automodel_notes(raw: dict[str, Any]) -> list[str]:
    raw = {**copy.deepcopy(raw), "output_dir": "/tmp/unused"}
    notes = list(load_config(copy.deepcopy(raw)).notes)
    # the lines of this test's concern: where AutoModel 0.7 trains the same file differently
    return [
        n
        for n in notes
        if n.startswith(("distributed.mp_policy", "rng.seed", "dataset.answer_only", "peft:"))
    ]


def test_notes_where_automodel_trains_the_same_file_differently(model_dir: str) -> None:
    """One start-up line each where NeMo AutoModel 0.7 would train the file differently, and only
    when it applies to the file: bf16 compute on CPU (no mp_policy), rng.seed (AutoModel seeds with
    the top-level seed, 42 by default), the last prompt token's label (prompt + completion data)."""
    raw = automodel_base(model_dir)  # rng.seed 1111, no top-level seed, no mp_policy, SQuAD
    mp, seed, bos = _automodel_notes(raw)
    assert mp.startswith("distributed.mp_policy unset: this run computes in fp32 on CPU") and "bf16" in mp
    assert seed.startswith("rng.seed=1111 seeds this run") and "(default 42): add seed: 1111" in seed
    assert bos.startswith("dataset.answer_only_loss_mask: the labels are each answer and its EOS")
    assert "tokenizer.add_bos_token" in bos
    # each one gone where the file is not affected
    policy = {"_target_": "torch.distributed.fsdp.MixedPrecisionPolicy", "param_dtype": "float32"}
    fixed = copy.deepcopy(raw)
    fixed["distributed"]["mp_policy"] = policy
    fixed["seed"] = 1111
    fixed["dataset"]["answer_only_loss_mask"] = False
    assert _automodel_notes(fixed) == []
    default_seed = copy.deepcopy(raw)
    default_seed["rng"]["seed"] = 42
    assert not [n for n in _automodel_notes(default_seed) if n.startswith("rng.seed")]
    lora = copy.deepcopy(fixed)
    lora["peft"] = {"_target_": "nemo_automodel.components._peft.lora.PeftConfig", "dim": 8}
    (note,) = _automodel_notes(lora)
    assert (
        note.startswith("peft: lora_A (xavier) is drawn from this run's per-parameter")
        and "seed + rank" in note
    )
    lora["peft"]["initial_adapter"] = "/adapter/AutoModel/starts/from"  # the same start: nothing to note
    assert _automodel_notes(lora) == []
    chat = copy.deepcopy(raw)
    chat["dataset"] = {"_target_": PREFIX + "chat_dataset.ChatDataset", "path_or_dataset_id": "chat.jsonl"}
    assert not [n for n in _automodel_notes(chat) if n.startswith("dataset.answer_only")]
    # a file of this project's own (no nemo_automodel target) gets none of them
    own = copy.deepcopy(raw)
    del own["recipe"], own["rng"]["_target_"], own["loss_fn"], own["dataloader"]["_target_"]
    own["model"] = {"pretrained_model_name_or_path": model_dir}
    own["dataset"] = {"source": "squad", "dataset_name": "squad.jsonl"}
    own["dataloader"].pop("collate_fn")
    assert _automodel_notes(own) == []


#: AutoModel's tensor-parallel keys, as its recipe files write them (flat in ``distributed:``).
_LLAMA_PLAN = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}


def _distributed(model_dir: str, **keys: Any) -> Any:
    """The parsed ``distributed:`` section of the AutoModel-shaped config with `keys` set (None: removed)."""
    base = automodel_base(model_dir)
    base["output_dir"] = "/tmp/unused"
    for key, value in keys.items():
        base["distributed"].pop(key, None)
        if value is not None:
            base["distributed"][key] = value
    return load_config(base).distributed


def _refusal(model_dir: str, **keys: Any) -> str:
    with pytest.raises(ConfigError) as refused:
        _distributed(model_dir, **keys)
    return str(refused.value)


def test_tensor_parallel_keys_are_the_tp_parallelisms_and_mean_what_automodel_means(model_dir: str) -> None:
    """AutoModel's ``distributed.sequence_parallel`` / ``tp_plan`` / ``enable_async_tensor_parallel``
    keep their YAML places and meaning, and land in the tp parallelism's own typed config: the same
    values the package's FSDP2Config (AutoModel's API) resolves them to, the same TP plan on the
    model, none of them among the strategy's flags."""
    import warnings

    from automodel.fsdp2 import FSDP2Config, TensorParallelConfig
    from automodel.fsdp2.tp_plan import plan_has_sequence_parallel, resolve_tp_plan
    from automodel.recipes.parallelisms.tp import shards_sequence, tensor_parallel_config
    from automodel.testing.tiny_model import tiny_llama

    model = tiny_llama()
    for keys in (
        {"tp_size": 2, "sequence_parallel": False},  # as 199 of AutoModel's recorded files
        {"tp_size": 2, "sequence_parallel": True},
        {"tp_size": 2, "sequence_parallel": True, "tp_plan": _LLAMA_PLAN},
        {"tp_size": 2, "enable_async_tensor_parallel": True},  # turns sequence parallelism on, as AutoModel
        {
            "_target_": "nemo_automodel.components.distributed.fsdp2.FSDP2Manager",
            "tp_size": 2,
            "sequence_parallel": True,
        },
    ):
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            section = _distributed(model_dir, **keys)
            package = FSDP2Config(**{k: v for k, v in keys.items() if k not in ("tp_size", "_target_")})
        tp = tensor_parallel_config(section.parallelism_configs)
        assert isinstance(tp, TensorParallelConfig) and tp == package.tensor_parallel, keys
        assert tp.sequence_parallel == package.sequence_parallel, keys
        assert package.sequence_parallel == (
            keys.get("sequence_parallel", False) or keys.get("enable_async_tensor_parallel", False)
        )
        if "enable_async_tensor_parallel" in keys:
            assert any("requires sequence_parallel" in str(w.message) for w in warned)
        # the strategy's flags hold no TP option (its config keeps the package defaults)
        assert not section.explicit_flags & {"sequence_parallel", "tp_plan", "enable_async_tensor_parallel"}
        config = section.strategy_config
        assert isinstance(config, FSDP2Config) and config.tensor_parallel == TensorParallelConfig()
        plan = resolve_tp_plan(model, tp_plan=tp.tp_plan, sequence_parallel=tp.sequence_parallel)
        same = resolve_tp_plan(model, tp_plan=package.tp_plan, sequence_parallel=package.sequence_parallel)
        assert {k: repr(v) for k, v in plan.items()} == {
            k: repr(v) for k, v in same.items()
        }  # styles: no __eq__
        assert plan_has_sequence_parallel(plan) == shards_sequence(model, configs=section.parallelism_configs)
        if tp.tp_plan is None:  # an explicit plan's own styles decide (AutoModel's rule too)
            assert plan_has_sequence_parallel(plan) == tp.sequence_parallel, keys
    # megatron-fsdp takes the plan, not sequence parallelism
    section = _distributed(model_dir, strategy="megatron_fsdp", tp_size=2, tp_plan=_LLAMA_PLAN)
    assert tensor_parallel_config(section.parallelism_configs).tp_plan == _LLAMA_PLAN


def test_tensor_parallel_keys_are_refused_as_before_naming_the_key(model_dir: str) -> None:
    """The refusals of AutoModel's TP keys are unchanged, key and message (recorded before the keys
    moved from the strategies' configs to the tp parallelism's)."""
    refusals = {
        "megatron_fsdp_with_sp": (
            {"strategy": "megatron_fsdp", "tp_size": 2, "sequence_parallel": True},
            "distributed.sequence_parallel=True: sequence_parallel=True is not supported with strategy megatron_fsdp (megatron-fsdp does not shard the sequence-parallel activations); use strategy fsdp2",
        ),
        "megatron_fsdp_with_async_tp": (
            {"strategy": "megatron_fsdp", "tp_size": 2, "enable_async_tensor_parallel": True},
            "distributed.enable_async_tensor_parallel=True: is not an option of strategy 'megatron_fsdp'",
        ),
        "megatron_fsdp_plan_not_a_path": (
            {"strategy": "megatron_fsdp", "tp_size": 2, "tp_plan": "plan"},
            "distributed.tp_plan='plan': tp_plan must be a dict of module FQN -> parallel style, or the import path of one (or of a function returning one), got 'plan'",
        ),
        "ddp_with_sp": (
            {"strategy": "ddp", "sequence_parallel": False},
            "distributed.sequence_parallel=False: is not an option of strategy 'ddp'",
        ),
        "ddp_with_plan": (
            {"strategy": "ddp", "sequence_parallel": None, "tp_plan": _LLAMA_PLAN},
            "distributed.tp_plan=" + repr(_LLAMA_PLAN) + ": is not an option of strategy 'ddp'",
        ),
        "sp_without_tp": (
            {"tp_size": 1, "sequence_parallel": True},
            "distributed.sequence_parallel=True: needs tp_size > 1 (sequence parallelism splits TP regions)",
        ),
        "async_without_tp": (
            {"tp_size": 1, "enable_async_tensor_parallel": True},
            "distributed.sequence_parallel=True: needs tp_size > 1 (sequence parallelism splits TP regions)",
        ),
        "sp_not_bool": (
            {"tp_size": 2, "sequence_parallel": "yes"},
            "distributed.sequence_parallel='yes': sequence_parallel must be a bool, got 'yes'",
        ),
        "plan_not_a_plan": (
            {"tp_size": 2, "tp_plan": 5},
            "distributed.tp_plan=5: tp_plan must be a dict, an import path string or None, got 5",
        ),
    }
    import warnings

    got = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (keys, _) in refusals.items():
            got[name] = _refusal(model_dir, **keys)
    assert got == {name: expected for name, (_, expected) in refusals.items()}
    # megatron_fsdp with sequence parallelism at tp_size 1: now the tp parallelism's own rule speaks
    # first (before: megatron-fsdp's); both name the key
    message = _refusal(model_dir, strategy="megatron_fsdp", tp_size=1, sequence_parallel=True)
    assert message.startswith("distributed.sequence_parallel=True: ")
