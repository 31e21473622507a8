"""Configs written in NeMo AutoModel's shapes (its keys, ``_target_`` class paths and dataset
factories, as its example recipes write them) train a few steps on tiny local stand-ins, and the
loss falls: SFT on SQuAD, HellaSwag, column-mapped and chat data, PEFT, TP, PP, CP, MoE with EP,
Megatron pretraining, packed sequences (and megatron_fsdp where CUDA is)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from automodel.testing.ranks import run_on_ranks
from automodel.testing.tiny_model import tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
from _cli_run import CliRun  # noqa: E402
from _recipe_helpers import preload, train_on_rank  # noqa: E402
from _sft_helpers import save_chat_tokenizer  # noqa: E402
from test_automodel_compat import PREFIX, automodel_base  # noqa: E402

preload()
TIMEOUT = 300
STEPS = 6


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny pretrained Llama (random weights, byte vocabulary) and small local copies of the
    datasets' real layouts: SQuAD's nested ``answers``, HellaSwag's ``endings`` + ``label``,
    prompt/completion rows, chat ``messages``; a chat tokenizer."""
    root = tmp_path_factory.mktemp("automodel_shapes")
    model = tiny_llama(max_position_embeddings=128)
    model.save_pretrained(root / "tiny-llama")
    names = ["Ada", "Bo", "Cy", "Di"]

    def jsonl(name: str, rows: list[dict[str, Any]]) -> str:
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(root / name)

    squad = [
        {
            "id": str(i),
            "context": f"{names[i % 4]} has {i % 9} cats.",
            "question": f"How many cats has {names[i % 4]}?",
            "answers": {"text": [str(i % 9)], "answer_start": [8]},
        }
        for i in range(48)
    ]
    hellaswag = [
        {"ctx": f"{names[i % 4]} counts to", "endings": ["one", "two", "three", "four"], "label": str(i % 4)}
        for i in range(48)
    ]
    prompts = [{"prompt": f"{i % 7} + 1 =", "completion": f" {i % 7 + 1}"} for i in range(48)]
    chat = [
        {
            "messages": [
                {"role": "user", "content": "say hi"},
                {"role": "assistant", "content": "hi" if i % 2 else "hello"},
            ]
        }
        for i in range(48)
    ]
    save_chat_tokenizer(root / "chat-tokenizer")
    return {
        "model": str(root / "tiny-llama"),
        "chat_tokenizer": str(root / "chat-tokenizer"),
        "squad": jsonl("squad.jsonl", squad),
        "hellaswag": jsonl("hellaswag.jsonl", hellaswag),
        "prompts": jsonl("prompts.jsonl", prompts),
        "chat": jsonl("chat.jsonl", chat),
        "root": str(root),
    }


def shape(paths: dict[str, str], out: Path, **sections: Any) -> dict[str, Any]:
    cfg = automodel_base(paths["model"])
    cfg["dataset"] = {
        "_target_": PREFIX + "squad.make_squad_dataset",
        "dataset_name": paths["squad"],
        "split": "train",
        "seq_length": 96,
    }
    cfg["step_scheduler"] = {
        "global_batch_size": 8,
        "local_batch_size": 2,
        "max_steps": STEPS,
        "val_every_steps": 100,
    }
    cfg["output_dir"] = str(out)
    for key, value in sections.items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict) and "_target_" not in value:
            cfg[key] = {**cfg[key], **value}  # a section with its own _target_ replaces the base's
        else:
            cfg[key] = value
    return cfg


def _falls(losses: list[float]) -> None:
    train = losses[:STEPS]
    assert len(train) == STEPS and train[-1] < 0.95 * train[0], train


def _train(cfg: dict, world: int = 1) -> list[list[float]]:
    results = run_on_ranks(train_on_rank, world_size=world, args=(cfg,), timeout_s=TIMEOUT)
    for losses in results:
        _falls(losses)
    return results


def test_sft_squad_and_hellaswag_with_validation(stand_ins: dict[str, str], tmp_path: Path) -> None:
    _train(shape(stand_ins, tmp_path / "squad"))
    hella = {
        "_target_": PREFIX + "hellaswag.HellaSwag",
        "path_or_dataset": stand_ins["hellaswag"],
        "seq_length": 32,
    }
    cfg = shape(
        stand_ins,
        tmp_path / "hellaswag",
        dataset={**hella, "split": "train"},
        validation_dataset={**hella, "split": "validation", "num_samples_limit": 16},
        validation_dataloader={
            "_target_": "torchdata.stateful_dataloader.StatefulDataLoader",
            "batch_size": 8,
        },
        lr_scheduler={"lr_decay_style": "cosine", "lr_warmup_steps": 1, "min_lr": 1.0e-4},
    )
    (losses,) = _train(cfg)
    assert len(losses) == STEPS + 1  # the validation loss at the end


def _validate_on_rank(raw: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """Rank function: build the run, then validate with val_batches None (all), all by number, 1."""
    from automodel.recipes import load_config
    from automodel.recipes.trainer import Trainer

    cfg = load_config(raw)
    trainer = Trainer(cfg)
    trainer.build()
    assert trainer.val_dataset is not None
    n = len(trainer.val_dataset) // cfg.step_scheduler.global_batch_size
    losses = {}
    for value in (None, n, 1):
        steps = dataclasses.replace(cfg.step_scheduler, val_batches=value)
        trainer.cfg = dataclasses.replace(trainer.cfg, step_scheduler=steps)  # the config is frozen
        losses[str(value)] = trainer.validate()
    return n, losses


def test_validation_over_all_of_the_set_as_automodel(stand_ins: dict[str, str], tmp_path: Path) -> None:
    """AutoModel evaluates the whole validation set: ``val_batches: null`` does that here; without
    the key the start-up line says what differs (the first val_batches global batches)."""
    from automodel.recipes import load_config

    squad = {
        "_target_": PREFIX + "squad.make_squad_dataset",
        "dataset_name": stand_ins["squad"],
        "seq_length": 96,
    }
    cfg = shape(stand_ins, tmp_path / "val", validation_dataset={**squad, "split": "train"})
    note = [line for line in load_config(cfg).notes if line.startswith("validation: ")]
    assert (
        note
        and "val_batches=2 global batches" in note[0]
        and "val_batches: null: all of it here too, the last batch smaller" in note[0]
    )
    cfg["step_scheduler"]["val_batches"] = None
    assert not [line for line in load_config(cfg).notes if line.startswith("validation: ")]
    ((n, losses),) = run_on_ranks(_validate_on_rank, world_size=1, args=(cfg,), timeout_s=TIMEOUT)
    assert n == 48 // 8
    assert losses["None"] == losses[str(n)] and losses["None"] != losses["1"], losses


def test_peft_column_mapped_and_chat(stand_ins: dict[str, str], tmp_path: Path) -> None:
    peft = {
        "_target_": "nemo_automodel.components._peft.lora.PeftConfig",
        "target_modules": "*_proj",
        "dim": 8,
        "alpha": 32,
        "use_triton": True,
    }
    mapped = {
        "_target_": PREFIX + "column_mapped_text_instruction_dataset.ColumnMappedTextInstructionDataset",
        "path_or_dataset_id": stand_ins["prompts"],
        "column_mapping": {"question": "prompt", "answer": "completion"},
        "answer_only_loss_mask": True,
        "seq_length": 32,
        "padding": "do_not_pad",
        "truncation": "longest_first",
    }
    _train(shape(stand_ins, tmp_path / "peft", peft=peft, dataset=mapped, optimizer={"lr": 1.0e-2}))
    chat = {
        "_target_": PREFIX + "chat_dataset.ChatDataset",
        "path_or_dataset_id": stand_ins["chat"],
        "seq_length": 32,
        "tokenizer": {
            "_target_": "transformers.AutoTokenizer.from_pretrained",
            "pretrained_model_name_or_path": stand_ins["chat_tokenizer"],
        },
    }
    _train(shape(stand_ins, tmp_path / "chat", dataset=chat))


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
#: what each layout leaves on rank 0 (layout/rank_0.json); with the parallelism off each fails
APPLIED = {
    "tp2": lambda r: _placement(r, Q_PROJ, "tp") == "S(0)",
    "pp2": lambda r: r["parts"][0]["layers"] == [0],
    "cp2": lambda r: r["cp_backend"] != "none" and r["coordinates"]["cp"] == 0,
}


def _placement(report: dict, fqn: str, axis: str) -> str | None:
    entry = report["parts"][0]["parameters"][fqn]
    mesh = entry["mesh"] or []
    return entry["placements"][mesh.index(axis)] if axis in mesh else None


@pytest.fixture(scope="module")
def reference(stand_ins: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The single-process losses of the SQuAD shape (the parallel layouts' oracle)."""
    (losses,) = _train(shape(stand_ins, tmp_path_factory.mktemp("reference") / "ref"))
    return losses


@pytest.mark.parametrize(
    "name,distributed",
    [
        ("tp2", {"tp_size": 2, "sequence_parallel": False}),
        ("pp2", {"pp_size": 2, "pipeline": {"pp_schedule": "1f1b", "pp_microbatch_size": 1, "patch_inner_model": False,
                                             "patch_causal_lm_model": False, "scale_grads_in_schedule": False}}),
        ("cp2", {"cp_size": 2}),
    ],
)  # fmt: skip
def test_parallel_layouts_match_one_process(
    name: str, distributed: dict, reference: list[float], stand_ins: dict[str, str], tmp_path: Path
) -> None:
    manager = {"_target_": "nemo_automodel.components.distributed.fsdp2.FSDP2Manager", **distributed}
    for losses in _train(shape(stand_ins, tmp_path / name, distributed=manager), world=2):
        assert losses == pytest.approx(reference, rel=1e-5)
    report = json.loads((tmp_path / name / "layout" / "rank_0.json").read_text())
    assert APPLIED[name](report), report["parts"][0]["parameters"].get(Q_PROJ)


def test_moe_with_expert_parallelism(stand_ins: dict[str, str], tmp_path: Path) -> None:
    model = {
        "_target_": "nemo_automodel.NeMoAutoModelForCausalLM.from_config",
        "config": {
            "_target_": "transformers.models.qwen3_moe.configuration_qwen3_moe.Qwen3MoeConfig",
            "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
            "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 128, "tie_word_embeddings": False,
            "decoder_sparse_step": 1, "mlp_only_layers": [],
        },
        "backend": {"_target_": "nemo_automodel.components.models.common.BackendConfig", "experts": "torch_mm",
                    "dispatcher": "torch"},
    }  # fmt: skip
    cfg = shape(
        stand_ins,
        tmp_path / "ep",
        model=model,
        distributed={"ep_size": 2, "moe": {"reshard_after_forward": False}},
    )
    _train(cfg, world=2)
    report = json.loads((tmp_path / "ep" / "layout" / "rank_0.json").read_text())
    experts = [e for fqn, e in report["parts"][0]["parameters"].items() if "experts" in fqn]
    assert experts and all("ep" in (e["mesh"] or []) for e in experts)


def test_megatron_pretraining_and_packed_sft(stand_ins: dict[str, str], tmp_path: Path) -> None:
    from test_pretrain_train import byte_corpus

    prefix = byte_corpus(tmp_path / "corpus", docs=300)
    data = {"_target_": PREFIX + "megatron_dataset.MegatronPretraining", "paths": [prefix], "seq_length": 32,
            "split": "0.95, 0.05, 0.00", "splits_to_build": "train", "index_mapping_dir": str(tmp_path / "map")}  # fmt: skip
    optimizer = {
        "_target_": "transformer_engine.pytorch.optimizers.fused_adam.FusedAdam", "lr": 3.0e-3, "betas": [0.9, 0.95],
        "weight_decay": 0.1, "adam_w_mode": True, "bias_correction": True, "master_weights": True,
        "store_param_remainders": True, "exp_avg_dtype": "torch.float32", "exp_avg_sq_dtype": "torch.float32",
    }  # fmt: skip
    _train(shape(stand_ins, tmp_path / "pretrain", dataset=data, optimizer=optimizer))
    packed = shape(
        stand_ins,
        tmp_path / "packed",
        packed_sequence={"packed_sequence_size": 128, "packing_strategy": "thd", "split_across_pack": False},
        dataloader={"collate_fn": "nemo_automodel.components.datasets.utils.packed_sequence_thd_collater"},
        step_scheduler={"local_batch_size": 4},
    )
    _train(packed)


@pytest.mark.gpu
def test_megatron_fsdp_where_cuda(stand_ins: dict[str, str], tmp_path: Path) -> None:
    from automodel.testing.ranks import cuda_device_count

    # probed in a child process: the test process must not initialise CUDA before ranks are forked
    if cuda_device_count() < 1:
        pytest.skip("megatron_fsdp needs CUDA")
    pytest.importorskip("megatron_fsdp", reason="megatron-fsdp is not importable (put its wheel in .whl/)")
    # the SQuAD stand-in is read through HF datasets, which the GPU runners lack
    pytest.importorskip("datasets", reason="HF datasets is not importable (put its wheel in .whl/)")
    cfg = shape(
        stand_ins, tmp_path / "mfsdp", distributed={"strategy": "megatron_fsdp"}, dist_env={"backend": "nccl"}
    )
    # the CLI in a child process: ranks forked from this test process cannot use CUDA once any
    # earlier test here has initialised it
    records = CliRun(out=tmp_path / "mfsdp", config=cfg, nproc=1).launch(timeout_s=TIMEOUT)
    _falls([r["loss"] for r in records])


def test_megatron_fsdp_case_set_up_on_cpu(stand_ins: dict[str, str], tmp_path: Path) -> None:
    """The GPU case's config and command, up to its first CUDA call (a stale key fails CI here)."""
    from automodel.recipes import load_config

    cfg = shape(
        stand_ins, tmp_path / "mfsdp", distributed={"strategy": "megatron_fsdp"}, dist_env={"backend": "nccl"}
    )
    run = CliRun(out=tmp_path / "mfsdp", config=cfg, nproc=1)
    cmd = run.write()
    assert cmd[-2:] == [str(run.config_path), "--nproc-per-node=1"]
    parsed = load_config(run.config_path)
    assert parsed.distributed.strategy == "megatron_fsdp" and parsed.output_dir == str(run.out)


def test_max_packs_and_a_checkpoint_per_epoch(stand_ins: dict[str, str], tmp_path: Path) -> None:
    """``packed_sequence.max_packs`` caps the packed rows (2 steps per epoch of 2 rows each) and
    ``save_checkpoint_every_epoch`` writes one at each epoch's last step, not only the final one."""
    cfg = shape(
        stand_ins,
        tmp_path / "run",
        packed_sequence={"packed_sequence_size": 128, "packing_strategy": "thd", "max_packs": 4},
        step_scheduler={
            "global_batch_size": 2,
            "local_batch_size": 1,
            "max_steps": None,
            "num_epochs": 2,
            "ckpt_every_steps": 50,
            "save_checkpoint_every_epoch": True,
        },  # fmt: skip
        checkpoint={"enabled": True, "checkpoint_dir": str(tmp_path / "ckpt")},
    )
    (losses,) = run_on_ranks(train_on_rank, world_size=1, args=(cfg,), timeout_s=TIMEOUT)
    assert len(losses) == 4, losses  # 2 epochs x (4 rows / 2 per step)
    steps = sorted(p.name for p in (tmp_path / "ckpt").glob("step_*"))
    assert steps == ["step_2", "step_4"], steps
