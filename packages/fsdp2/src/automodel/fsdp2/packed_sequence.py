"""``patch_is_packed_sequence``: make transformers' packed-sequence probe a constant False."""

from __future__ import annotations


def _never_packed(position_ids, batch_size) -> bool:  # noqa: ARG001 - signature of the patched function
    return False


def patch_is_packed_sequence() -> bool:
    """Replace ``transformers.modeling_flash_attention_utils._is_packed_sequence`` by ``False``.

    Removes a device sync per attention layer and keeps attention shapes static for compile.
    Only for non-packed training. Returns False when transformers (or the function) is absent.
    """
    try:
        # optional dependency of this package
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:
        return False
    if not hasattr(fa_utils, "_is_packed_sequence"):
        return False
    fa_utils._is_packed_sequence = _never_packed
    return True
