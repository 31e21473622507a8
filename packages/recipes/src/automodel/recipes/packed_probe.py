"""transformers' packed-sequence probe, decided per run from the data.

With flash attention, transformers asks ``_is_packed_sequence(position_ids)`` in every attention
layer whether a row holds several documents: a device sync per layer, and shapes compile cannot
keep static. When no row is packed (``packed_sequence.packed_sequence_size`` 0: positions are
0..n-1 in every row) its answer is always False, so the recipes replace it by the constant
(`automodel.fsdp2.patch_is_packed_sequence`), unless the YAML sets
``distributed.patch_is_packed_sequence`` itself. Set on every run, so an earlier run's patch never
reaches a later run in the same process that packs its rows.
"""

from __future__ import annotations

from automodel.fsdp2.packed_sequence import patch_is_packed_sequence, restore_is_packed_sequence
from automodel.recipes.config.recipe import RecipeConfig


def packed_probe_patched(cfg: RecipeConfig) -> bool:
    """Whether the probe is replaced for `cfg`: the YAML's ``distributed.patch_is_packed_sequence``,
    else True exactly when no row is packed."""
    d = cfg.distributed
    if "patch_is_packed_sequence" in d.explicit_flags:
        return d.strategy_config.patch_is_packed_sequence
    return cfg.packed_sequence.packed_sequence_size == 0


def apply_packed_probe(cfg: RecipeConfig) -> bool:
    """Patch or restore the probe as `packed_probe_patched` decides; returns whether it is patched."""
    if packed_probe_patched(cfg):
        return patch_is_packed_sequence()
    restore_is_packed_sequence()
    return False
