"""A world of one that shards nothing gets no FSDP wrapping (`strategies.single`), unless the YAML
names a strategy or a strategy flag; the loss is the FSDP2 world-of-one run's."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from automodel.recipes import load_config
from automodel.recipes._dist_setup import resolve_layout, resolve_machine_defaults
from automodel.recipes.errors import ConfigError
from automodel.testing.ranks import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import preload, tiny_config  # noqa: E402


@pytest.mark.parametrize(
    ("distributed", "dtype", "cuda", "world", "expected"),
    [
        (None, "float32", False, 1, "single"),  # CPU: FSDP2 would compute in fp32 too
        (None, "float32", True, 1, "fsdp2"),  # CUDA: bf16 compute over fp32 weights is FSDP2's
        (None, "bf16", True, 1, "single"),  # all bf16: nothing for FSDP2 to do
        (None, "float32", False, 2, "fsdp2"),
        ({"backend": "gloo"}, "float32", False, 1, "single"),  # the backend asks for no wrapper
        ({"strategy": "fsdp2"}, "float32", False, 1, "fsdp2"),
        ({"activation_checkpointing": True}, "float32", False, 1, "fsdp2"),
    ],
)
def test_which_strategy_a_world_of_one_gets(
    distributed: dict | None, dtype: str, cuda: bool, world: int, expected: str, tmp_path: Path
) -> None:
    raw = tiny_config(str(tmp_path), distributed=None, model={"dtype": dtype})
    if distributed is not None:  # exactly these keys (tiny_config's own names the strategy)
        raw["distributed"] = distributed
    cfg = load_config(raw)
    section = resolve_machine_defaults(
        cfg.distributed, cuda=cuda, world_size=world, param_dtype=cfg.model.dtype
    )
    assert section.strategy == expected
    assert (section.chosen_because is not None) == (expected == "single")


def test_single_is_refused_for_more_than_one_rank(tmp_path: Path) -> None:
    cfg = load_config(tiny_config(str(tmp_path), distributed={"strategy": "single"}))
    with pytest.raises(ConfigError, match="distributed.strategy='single': trains one process.*2 ranks"):
        resolve_layout(cfg.distributed, 2)
    with pytest.raises(ConfigError, match="distributed.tp_size=2: strategy single trains one process"):
        load_config(tiny_config(str(tmp_path), distributed={"strategy": "single", "tp_size": 2}))


def _train_and_inspect(raw: dict[str, Any]) -> tuple[str, bool, list[float]]:
    """Rank function: the strategy used, whether anything is FSDP-wrapped or a DTensor, the losses."""
    from automodel.recipes.trainer import Trainer

    trainer = Trainer(load_config(raw))
    trainer.build()
    parts = trainer.pm.parts
    wrapped = any(isinstance(m, FSDPModule) for p in parts for m in p.modules()) or any(
        isinstance(q, DTensor) for p in parts for q in p.parameters()
    )
    result = trainer.train()
    return trainer.cfg.distributed.strategy, wrapped, result.losses


def test_world_of_one_trains_unwrapped_with_the_fsdp2_loss(
    tmp_path: Path, capfd: pytest.CaptureFixture
) -> None:
    preload()
    plain = tiny_config(str(tmp_path / "plain"), distributed=None)
    explicit = tiny_config(str(tmp_path / "fsdp2"), distributed={"strategy": "fsdp2"})
    [(name, wrapped, losses)] = run_on_ranks(_train_and_inspect, world_size=1, args=(plain,), timeout_s=300)
    assert (name, wrapped) == ("single", False)
    err = capfd.readouterr().err
    assert "strategy single: a world of one shards nothing, so no fsdp2 wrapping" in err, err
    [(name, wrapped, reference)] = run_on_ranks(
        _train_and_inspect, world_size=1, args=(explicit,), timeout_s=300
    )
    assert (name, wrapped) == ("fsdp2", True)  # the YAML asked for it
    assert len(losses) == len(reference) == 3
    for got, ref in zip(losses, reference):
        assert abs(got - ref) <= 1e-6 * abs(ref), (losses, reference)
