"""The config is typed once: built sections, machine defaults decided at launch by one function,
and the Python API running every pre-launch rule (the model-dependent ones too)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from automodel.fsdp2 import FSDP2Config
from automodel.megatron_fsdp.config import MegatronFSDPConfig
from automodel.recipes import load_config
from automodel.recipes._dist_setup import resolve_machine_defaults
from automodel.recipes.parallelisms.tp import tensor_parallel_config
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402


def test_sections_are_built_and_frozen(tmp_path: Path) -> None:
    from automodel.pipeline import PipelineConfig
    from automodel.recipes.checkpoint import CheckpointConfig

    cfg = load_config(
        tiny_config(
            str(tmp_path),
            checkpoint={"enabled": True, "keep_last_n": 2},
            distributed={"pp_size": 2, "pipeline": {"pp_schedule": "gpipe"}},
        )
    )
    assert isinstance(cfg.checkpoint, CheckpointConfig) and cfg.checkpoint.keep_last_n == 2
    assert isinstance(cfg.distributed.pipeline_config, PipelineConfig)
    assert cfg.distributed.pipeline_config.pp_batch_size == cfg.step_scheduler.local_batch_size
    for section in (cfg.checkpoint, cfg.distributed):
        field = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, field, None)  # any field of a section, by name


@pytest.mark.parametrize("cuda", [False, True])
def test_machine_defaults_are_resolved_at_launch(cuda: bool, tmp_path: Path) -> None:
    """Parsing gives the same section on every machine; `resolve_machine_defaults` decides what
    the YAML left out (bf16 mixed precision and nccl on CUDA, full precision and gloo on CPU)."""
    section = load_config(tiny_config(str(tmp_path))).distributed
    assert section.machine_keys == {"backend", "mp_policy"}
    resolved = resolve_machine_defaults(section, cuda=cuda)
    assert resolved.machine_keys == frozenset()
    assert isinstance(resolved.strategy_config, FSDP2Config)
    mp = resolved.strategy_config.mp_policy
    assert mp is not None
    assert (mp.param_dtype, resolved.strategy_config.backend) == (
        (torch.bfloat16, "nccl") if cuda else (None, "gloo")
    )
    given = load_config(tiny_config(str(tmp_path), distributed={"mp_policy": {"param_dtype": "bf16"}}))
    kept = resolve_machine_defaults(given.distributed, cuda=cuda).strategy_config
    assert isinstance(kept, FSDP2Config) and kept.mp_policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16
    )


REFORMER = {
    "model_type": "reformer",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "attn_layers": ["local", "local"],
    "axial_pos_shape": [8, 8],
    "axial_pos_embds_dim": [32, 32],
    "num_attention_heads": 2,
    "attention_head_size": 32,
    "feed_forward_size": 64,
    "is_decoder": True,
}


def _train_with_python_api(raw: dict) -> None:
    from automodel.recipes import train

    train(raw)


def test_python_api_runs_the_model_dependent_rules(tmp_path: Path) -> None:
    """`automodel.recipes.train` refuses what `recipes validate` refuses, the rules that need
    the model included (reversible layers under FSDP2), before parallelizing anything."""
    raw = tiny_config(str(tmp_path), model={"config": REFORMER})
    with pytest.raises(Exception, match="distributed.strategy.*cannot train model_type 'reformer'"):
        run_on_ranks(_train_with_python_api, world_size=1, args=(raw,), timeout_s=300)


def test_megatron_machine_defaults_keep_its_tp_plan(tmp_path: Path) -> None:
    """megatron-fsdp's tp_plan is the tp parallelism's (its `TensorParallelConfig`), not the
    strategy config's: resolving the backend keeps it, and megatron-fsdp's manager is handed it."""
    plan = {"model.layers.*.self_attn.q_proj": "colwise"}
    raw = tiny_config(str(tmp_path), distributed={"strategy": "megatron_fsdp", "tp_plan": plan})
    section = load_config(raw).distributed
    assert section.machine_keys == {"backend"}
    resolved = resolve_machine_defaults(section, cuda=True)
    assert isinstance(resolved.strategy_config, MegatronFSDPConfig)
    assert resolved.strategy_config.custom_tp_plan is None  # the strategy's flags hold no TP option
    tp = tensor_parallel_config(resolved.parallelism_configs)
    assert (resolved.strategy_config.backend, tp.tp_plan, tp.sequence_parallel) == ("nccl", plan, False)
