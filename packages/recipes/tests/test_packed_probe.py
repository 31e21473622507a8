"""transformers' packed-sequence probe is the constant False exactly when no row is packed, unless
the YAML sets ``distributed.patch_is_packed_sequence``; set on every run (both ways)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from automodel.fsdp2.packed_sequence import is_packed_sequence_patched, restore_is_packed_sequence
from automodel.recipes import load_config
from automodel.recipes.errors import ConfigError
from automodel.recipes.packed_probe import apply_packed_probe

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402

PACKED = {"packed_sequence": {"packed_sequence_size": 32}, "step_scheduler": {"local_batch_size": 1}}


@pytest.mark.parametrize(
    ("sections", "patched"),
    [
        ({}, True),  # no row packed: the probe's answer is always False
        (PACKED, False),  # packed rows: transformers must look
        ({"distributed": {"patch_is_packed_sequence": False}}, False),  # the YAML decides
        ({"distributed": {"patch_is_packed_sequence": True}}, True),
    ],
    ids=["unpacked", "packed", "explicit_false", "explicit_true"],
)
def test_the_probe_follows_the_rows(sections: dict, patched: bool, tmp_path: Path) -> None:
    from transformers import modeling_flash_attention_utils as fa_utils

    restore_is_packed_sequence()
    original = fa_utils._is_packed_sequence
    try:
        for _ in range(2):  # a second run flips nothing back by accident
            cfg = load_config(tiny_config(str(tmp_path), **sections))
            assert apply_packed_probe(cfg) is patched
            assert is_packed_sequence_patched() is patched
        # the next run packs its rows: an earlier patch never reaches it
        apply_packed_probe(load_config(tiny_config(str(tmp_path), **PACKED)))
        assert fa_utils._is_packed_sequence is original
    finally:
        restore_is_packed_sequence()


def test_asking_for_the_patch_with_packed_rows_is_refused(tmp_path: Path) -> None:
    raw = tiny_config(str(tmp_path), distributed={"patch_is_packed_sequence": True}, **PACKED)
    with pytest.raises(ConfigError, match="distributed.patch_is_packed_sequence=True: makes transformers"):
        load_config(raw)
