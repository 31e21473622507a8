"""Bad configs exit with code 2 and one line naming the key and value; nothing is written.

The cases run in-process through `run_cli`, the code path of the console script; two of them
also run as real subprocesses to check the exit code and that no traceback is printed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from automodel.recipes._dist_setup import parse_distributed_section
from automodel.recipes.cli import run_cli
from automodel.testing.ranks import cuda_device_count

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402

_DELETE = object()


def _set(cfg: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = cfg
    for p in parents:
        node = node.setdefault(p, {})
    if value is _DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value


# (id, {dotted key: value}, extra CLI args, expected key named in the error line)
CASES: list[tuple[str, dict[str, Any], list[str], str]] = [
    ("missing_model", {"model": _DELETE}, [], "model"),
    ("model_not_mapping", {"model": 5}, [], "model"),
    ("unknown_top_level", {"modle": {}}, [], "modle"),
    ("missing_model_type", {"model.config.model_type": _DELETE}, [], "model.config.model_type"),
    ("unknown_model_type", {"model.config.model_type": "not_a_model"}, [], "model.config.model_type"),
    ("config_and_pretrained", {"model.pretrained_path": "/nonexistent"}, [], "model"),
    ("pretrained_missing", {"model.config": _DELETE, "model.pretrained_path": "/nonexistent"}, [], "model.pretrained_path"),
    ("model_dtype", {"model.dtype": "int8"}, [], "model.dtype"),
    ("attn_unknown", {"model.attn_implementation": "fast"}, [], "model.attn_implementation"),
    # bloom declares no sdpa support: the error names the model_type and what it supports
    ("attn_unsupported", {"model.config": {"model_type": "bloom", "n_head": 4, "hidden_size": 64, "n_layer": 2, "vocab_size": 256}, "model.attn_implementation": "sdpa"}, [], "model.attn_implementation"),
    ("vocab_too_small", {"model.config.vocab_size": 100}, [], "model.config.vocab_size"),
    # per-layer head counts (transformers' per_layer_config) on a model whose code reads one value
    ("per_layer_unsupported", {"model.config.per_layer_config": {1: {"num_key_value_heads": 1}}}, [], "model.config.per_layer_config"),
    # every layer's count is checked against tp (Gemma 4's full-attention layers have their own KV heads)
    ("per_layer_heads_vs_tp", {"model.config": {"model_type": "gemma4_text", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True, "layer_types": ["sliding_attention", "full_attention"], "vocab_size": 256, "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 16}, "distributed.tp_size": 2}, ["--nproc-per-node=2"], "distributed.tp_size"),
    ("dataset_source", {"dataset.source": "web"}, [], "dataset.source"),
    ("dataset_path_missing", {"dataset.source": "json"}, [], "dataset.path"),
    ("dataset_file_missing", {"dataset.source": "json", "dataset.path": "/nonexistent/train.jsonl"}, ["--nproc-per-node=2"], "dataset.path"),
    ("seq_length_type", {"dataset.seq_length": "long"}, [], "dataset.seq_length"),
    ("seq_length_small", {"dataset.seq_length": 1}, [], "dataset.seq_length"),
    ("dataset_unknown_key", {"dataset.shuffle_buffer": 10}, [], "dataset.shuffle_buffer"),
    ("val_split", {"validation_dataset": {"split": "test"}}, [], "validation_dataset.split"),
    ("tokenizer_path", {"tokenizer.path": "/nonexistent/tok"}, [], "tokenizer.path"),
    ("global_batch_zero", {"step_scheduler.global_batch_size": 0}, [], "step_scheduler.global_batch_size"),
    ("global_not_multiple", {"step_scheduler.global_batch_size": 7}, [], "step_scheduler.global_batch_size"),
    ("max_steps_type", {"step_scheduler.max_steps": "ten"}, [], "step_scheduler.max_steps"),
    ("optimizer_no_target", {"optimizer._target_": _DELETE}, [], "optimizer._target_"),
    ("optimizer_not_optimizer", {"optimizer._target_": "torch.nn.Linear"}, [], "optimizer._target_"),
    ("optimizer_unimportable", {"optimizer._target_": "no_such_pkg.Optim"}, [], "optimizer._target_"),
    ("optimizer_lr", {"optimizer.lr": -1}, [], "optimizer.lr"),
    ("optimizer_kwarg_typo", {"optimizer.weight_decayy": 0.1}, [], "optimizer.weight_decayy"),
    ("optimizer_betas_short", {"optimizer.betas": [0.9]}, [], "optimizer.betas"),
    ("optimizer_eps_negative", {"optimizer.eps": -1}, [], "optimizer.eps"),
    ("model_config_typo", {"model.config.num_hidden_layer": 2}, [], "model.config.num_hidden_layer"),
    ("restore_from_missing", {"checkpoint": {"enabled": True, "restore_from": "step_99"}}, [], "checkpoint.restore_from"),
    ("decay_style", {"lr_scheduler.decay_style": "exp"}, [], "lr_scheduler.decay_style"),
    ("min_lr", {"lr_scheduler.min_lr": -0.1}, [], "lr_scheduler.min_lr"),
    ("loss_fn", {"loss_fn": "no_such_pkg.loss"}, [], "loss_fn"),
    ("strategy", {"distributed.strategy": "zero3"}, [], "distributed.strategy"),
    ("tp_zero", {"distributed.tp_size": 0}, [], "distributed.tp_size"),
    ("tp_type", {"distributed.tp_size": "two"}, [], "distributed.tp_size"),
    ("distributed_unknown", {"distributed.tensor_parallel": 2}, [], "distributed.tensor_parallel"),
    ("flag_of_other_strategy", {"distributed.strategy": "ddp", "distributed.enable_compile": True}, [], "distributed.enable_compile"),
    ("pp_without_pipeline", {"distributed.pp_size": 2}, [], "distributed.pp_size"),
    ("ddp_with_tp", {"distributed.strategy": "ddp", "distributed.tp_size": 2}, [], "distributed.tp_size"),
    ("megatron_with_pp", {"distributed.strategy": "megatron_fsdp", "distributed.pp_size": 2, "distributed.pipeline": {}}, [], "distributed.pp_size"),
    ("megatron_with_sp", {"distributed.strategy": "megatron_fsdp", "distributed.tp_size": 2, "distributed.sequence_parallel": True}, [], "distributed.sequence_parallel"),
    ("megatron_with_ep", {"distributed.strategy": "megatron_fsdp", "distributed.ep_size": 2}, [], "distributed.ep_size"),
    ("megatron_with_cp", {"distributed.strategy": "megatron_fsdp", "distributed.cp_size": 2}, [], "distributed.cp_size"),
    ("replicate_with_ddp", {"distributed.strategy": "ddp", "distributed.dp_replicate_size": 2}, [], "distributed.dp_replicate_size"),
    ("sp_without_tp", {"distributed.sequence_parallel": True}, [], "distributed.sequence_parallel"),
    ("defer_with_ddp", {"distributed.strategy": "ddp", "distributed.defer_fsdp_grad_sync": True}, [], "distributed.defer_fsdp_grad_sync"),
    ("ac_not_bool", {"distributed.activation_checkpointing": "yes"}, [], "distributed.activation_checkpointing"),
    ("prefetch_depth", {"distributed.fsdp2_backward_prefetch_depth": 0}, [], "distributed.fsdp2_backward_prefetch_depth"),
    ("mp_policy_target", {"distributed.mp_policy": {"_target_": "no_such_pkg.Policy"}}, [], "distributed.mp_policy._target_"),
    ("packed_negative", {"packed_sequence.packed_sequence_size": -1}, [], "packed_sequence.packed_sequence_size"),
    ("ckpt_format", {"checkpoint.enabled": True, "checkpoint.model_save_format": "pickle"}, [], "checkpoint.model_save_format"),
    ("ckpt_keep", {"checkpoint.enabled": True, "checkpoint.keep_last_n": 0}, [], "checkpoint.keep_last_n"),
    ("ckpt_unknown", {"checkpoint.every": 3}, [], "checkpoint.every"),
    ("seed", {"seed": -1}, [], "seed"),
    ("timeout", {"dist_env.timeout_minutes": 0}, [], "dist_env.timeout_minutes"),
    ("tensorboard_type", {"logging.tensorboard": "yes"}, [], "logging.tensorboard"),
    ("max_norm", {"clip_grad_norm.max_norm": 0}, [], "clip_grad_norm.max_norm"),
    ("bad_override", {}, ["--distributed.tp_size"], "--distributed.tp_size"),
    ("override_into_value", {}, ["--seed.x=1"], "seed"),
    # rules that need the world size: planned for the asked number of processes, before any launch
    ("world_not_divisible", {"distributed.tp_size": 2}, ["--nproc-per-node=3"], "distributed"),
    ("heads_vs_tp", {"distributed.tp_size": 3}, ["--nproc-per-node=3"], "distributed.tp_size"),
    ("dp_size_mismatch", {"distributed.dp_size": 3}, ["--nproc-per-node=2"], "distributed"),
    ("replicate_not_dividing", {"distributed.dp_replicate_size": 3}, ["--nproc-per-node=4"], "distributed"),
    ("ep_on_dense_model", {"distributed.ep_size": 2}, ["--nproc-per-node=2"], "distributed.ep_size"),
    ("sp_on_moe_model", {"model.config": {"model_type": "qwen3_moe", "num_experts": 4, "num_attention_heads": 4, "num_key_value_heads": 2}, "distributed.tp_size": 2, "distributed.sequence_parallel": True}, ["--nproc-per-node=2"], "distributed.sequence_parallel"),
    ("seq_vs_cp", {"distributed.cp_size": 2, "dataset.seq_length": 30}, ["--nproc-per-node=2"], "dataset.seq_length"),
    # a stage boundary carries each tp rank's equal share of the sequence-sharded hidden states
    ("seq_vs_sp_pp", {"distributed.tp_size": 2, "distributed.sequence_parallel": True, "distributed.pp_size": 2, "distributed.pipeline": {}, "dataset.seq_length": 31}, ["--nproc-per-node=4"], "dataset.seq_length"),
    # X-MOD takes lang_ids, which training does not pass, else config.default_language (None by default)
    ("xmod_default_language", {"model.config": {"model_type": "xmod", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128, "is_decoder": True}}, ["--nproc-per-node=2"], "model.config.default_language"),
    ("layers_vs_stages", {"distributed.pp_size": 2, "distributed.pipeline": {"pp_schedule": "interleaved1f1b"}}, ["--nproc-per-node=2"], "distributed.pp_size"),
    ("microbatches_vs_pp", {"distributed.pp_size": 2, "distributed.pipeline": {"pp_microbatch_size": 2}}, ["--nproc-per-node=2"], "step_scheduler.local_batch_size"),
    # Interleaved1F1B runs micro-batches in equal rounds: 5 of them over pp_size 2 cannot be
    ("microbatch_rounds", {"model.config.num_hidden_layers": 4, "distributed.pp_size": 2, "distributed.pipeline": {"pp_schedule": "interleaved1f1b"}, "step_scheduler.global_batch_size": 5, "step_scheduler.local_batch_size": 5}, ["--nproc-per-node=2"], "step_scheduler.local_batch_size"),
    ("local_batch_vs_microbatch", {"distributed.pp_size": 2, "distributed.pipeline": {"pp_microbatch_size": 3}}, ["--nproc-per-node=2"], "step_scheduler.local_batch_size"),
    ("pipeline_bad_microbatch", {"distributed.pp_size": 2, "distributed.pipeline": {"pp_microbatch_size": 0}}, ["--nproc-per-node=2"], "distributed.pipeline.pp_microbatch_size"),
    ("pipeline_csv_missing", {"distributed.pp_size": 2, "distributed.pipeline": {"pp_schedule_csv": "/nonexistent/schedule.csv"}}, ["--nproc-per-node=2"], "distributed.pipeline.pp_schedule_csv"),
    ("megatron_meta_init", {"distributed.strategy": "megatron_fsdp", "distributed.init_fsdp_with_meta_device": True}, [], "distributed.init_fsdp_with_meta_device"),
    ("batch_vs_dp", {"step_scheduler.global_batch_size": 6}, ["--nproc-per-node=2"], "step_scheduler.global_batch_size"),
    ("layout_report", {"logging.layout_report": "rank1"}, [], "logging.layout_report"),
    # issue 34, beyond the probe: bad_rows values and sources, a checkpoint_dir that is a file
    ("bad_rows_value", {"dataset.bad_rows": "drop"}, [], "dataset.bad_rows"),
    ("bad_rows_skip_embedded", {"dataset.bad_rows": "skip"}, [], "dataset.bad_rows"),
    ("val_bad_rows_value", {"validation_dataset": {"bad_rows": "ignore"}}, [], "validation_dataset.bad_rows"),
    ("checkpoint_dir_is_file", {"checkpoint": {"enabled": True, "checkpoint_dir": __file__}}, ["--nproc-per-node=2"], "checkpoint.checkpoint_dir"),
]  # fmt: skip


def _write(tmp_path: Path, changes: dict[str, Any]) -> tuple[Path, Path]:
    out = tmp_path / "out"
    cfg = tiny_config(str(out))
    for key, value in changes.items():
        _set(cfg, key, value)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_config_exits_2_with_one_line(case, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _, changes, extra, key = case
    path, out = _write(tmp_path, changes)
    code = run_cli(["train", str(path), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert code == 2, err
    assert len(errors) == 1 and "Traceback" not in "\n".join(err), err
    assert errors[0].startswith(f"error: {key}="), errors[0]
    assert not out.exists()


def test_model_config_typo_suggests_the_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``num_hidden_layer: 2`` trained transformers' default of 32 layers; now refused with a hint."""
    path, out = _write(tmp_path, {"model.config.num_hidden_layer": 2})
    assert run_cli(["train", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith("error: model.config.num_hidden_layer=2")
        and "did you mean 'num_hidden_layers'" in line
    )
    assert not out.exists()


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the refusal on machines without CUDA")
@pytest.mark.parametrize("extra", [[], ["--nproc-per-node=2"]], ids=["in_place", "before_launch"])
def test_megatron_fsdp_without_cuda_is_refused_before_any_rank_starts(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path, out = _write(tmp_path, {"distributed.strategy": "megatron_fsdp", "distributed.tp_size": 2})
    assert run_cli(["train", str(path), *extra]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "error: distributed.strategy='megatron_fsdp': strategy megatron_fsdp needs CUDA"
    ), line
    assert "torch.cuda.is_available() is False" in line and "fsdp2" in line
    assert not out.exists()
    # validate plans for a GPU cluster from any machine: no refusal there
    assert run_cli(["validate", str(path), "--world-size", "8"]) == 0


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the refusal on machines without CUDA")
@pytest.mark.parametrize("extra", [[], ["--nproc-per-node=2"]], ids=["in_place", "before_launch"])
def test_pinned_offload_without_cuda_is_refused_before_any_rank_starts(
    extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Torch's CPUOffloadPolicy pins memory by default, through the CUDA driver: it failed in every
    rank (`automodel.fsdp2.fsdp.check_offload_policy`); the FSDP2 strategy's `check_environment`
    refuses it in the launching process, with torch's reason."""
    path, out = _write(tmp_path, {"distributed.offload_policy": {"pin_memory": True}})
    assert run_cli(["train", str(path), *extra]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(
        "error: distributed.offload_policy=CPUOffloadPolicy(pin_memory=True): needs CUDA: torch pins"
    ), line
    assert "pin_memory=False" in line
    assert not out.exists()
    assert run_cli(["validate", str(path), "--world-size", "2"]) == 0  # planning for a GPU cluster
    unpinned, _ = _write(tmp_path, {"distributed.offload_policy": {"pin_memory": False}})
    assert run_cli(["validate", str(unpinned), "--world-size", "2"]) == 0


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the refusals on machines without CUDA")
@pytest.mark.parametrize(
    ("attn", "says"),
    [("flex_attention", "has no backward on CPU"), ("flash_attention_2", "needs the flash-attn package")],
)
@pytest.mark.parametrize("extra", [[], ["--nproc-per-node=2"]], ids=["in_place", "before_launch"])
def test_attention_this_machine_cannot_train_with_is_refused_before_any_rank_starts(
    attn: str, says: str, extra: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Llama supports both; here (no CUDA, no flash-attn) each failed inside every rank's first step
    (FlexAttention's NotImplementedError, transformers' ImportError)."""
    path, out = _write(tmp_path, {"model.attn_implementation": attn})
    assert run_cli(["train", str(path), *extra]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: model.attn_implementation='{attn}': {says}"), line
    assert not out.exists()
    assert run_cli(["validate", str(path), "--world-size", "2"]) == 0  # planning for a GPU cluster


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks the refusal on machines without CUDA")
def test_nccl_without_cuda_is_refused_before_launch(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, out = _write(tmp_path, {"dist_env.backend": "nccl"})
    assert run_cli(["train", str(path), "--nproc-per-node=2"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: dist_env.backend='nccl': needs CUDA GPUs"), line
    assert not out.exists()


def test_launcher_flag_given_to_validate_names_world_size(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path, _ = _write(tmp_path, {})
    assert run_cli(["validate", str(path), "--nproc-per-node", "4"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --nproc-per-node=None: is a `recipes train` launcher option"), line
    assert "--world-size N" in line


def test_missing_file_and_invalid_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run_cli(["validate", str(tmp_path / "nope.yaml")]) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    assert run_cli(["validate", str(bad)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("error: config=") and "no such file" in lines[0]
    assert lines[1].startswith("error: config=") and "not valid YAML" in lines[1]


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "{cfg}", "--world-size=3", "--distributed.tp_size=3"],
        ["train", "{cfg}", "--nproc-per-node=2", "--distributed.strategy=zero3"],
    ],
    ids=["validate", "train_launcher"],
)
def test_subprocess_exit_code_2(argv: list[str], tmp_path: Path) -> None:
    path, out = _write(tmp_path, {})
    cmd = [sys.executable, "-m", "automodel.recipes.cli", *(a.format(cfg=path) for a in argv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: distributed."), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_attn_implementation_auto_follows_what_the_model_supports() -> None:
    from transformers import AutoConfig

    from automodel.recipes.errors import ConfigError
    from automodel.recipes.model import resolve_attn_implementation

    assert resolve_attn_implementation(AutoConfig.for_model("llama"), "auto") == "sdpa"
    assert resolve_attn_implementation(AutoConfig.for_model("bloom"), "auto") == "eager"  # no sdpa in bloom
    assert resolve_attn_implementation(AutoConfig.for_model("gpt_oss"), "auto") == "eager"
    assert resolve_attn_implementation(AutoConfig.for_model("gpt_oss"), "flex_attention") == "flex_attention"
    with pytest.raises(ConfigError, match=r"model_type 'gpt_oss' .*supports eager, flex_attention"):
        resolve_attn_implementation(AutoConfig.for_model("gpt_oss"), "sdpa")


def test_ep_takes_every_fsdp2_option() -> None:
    """Compile, offload, prefetch and autocast go through the FSDP2 strategy's one applier with EP
    too (parity: test_moe_ep_parity.py), so the section accepts them with ep_size > 1."""
    offload = {"_target_": "torch.distributed.fsdp.CPUOffloadPolicy", "pin_memory": False}
    options = {"enable_compile": True, "offload_policy": offload, "enable_fsdp2_prefetch": True}
    section = parse_distributed_section({"ep_size": 2, "autocast_dtype": "bfloat16", **options})
    assert section.moe_config is not None
