"""``patch_is_packed_sequence``: make transformers' packed-sequence probe a constant False."""

from __future__ import annotations

#: Where `patch_is_packed_sequence` keeps transformers' own probe (an attribute of its module).
_ORIGINAL = "_automodel_original_is_packed_sequence"


def _never_packed(position_ids, batch_size) -> bool:  # noqa: ARG001 - signature of the patched function
    return False


def patch_is_packed_sequence() -> bool:
    """Replace ``transformers.modeling_flash_attention_utils._is_packed_sequence`` by ``False``.

    Removes a device sync per attention layer and keeps attention shapes static for compile.
    Only for non-packed training. Returns False when transformers (or the function) is absent.
    """
    try:
        # lazy: optional dependency of this package (transformers)
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:
        return False
    if not hasattr(fa_utils, "_is_packed_sequence"):
        return False
    if fa_utils._is_packed_sequence is not _never_packed:
        setattr(fa_utils, _ORIGINAL, fa_utils._is_packed_sequence)  # for restore_is_packed_sequence
    fa_utils._is_packed_sequence = _never_packed
    return True


def restore_is_packed_sequence() -> None:
    """Undo `patch_is_packed_sequence` (a later run in this process may pack its rows)."""
    try:
        # lazy: optional dependency of this package (transformers)
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:
        return
    original = getattr(fa_utils, _ORIGINAL, None)
    if original is not None:
        fa_utils._is_packed_sequence = original


def is_packed_sequence_patched() -> bool:
    """Whether transformers' packed-sequence probe is the constant False of `patch_is_packed_sequence`."""
    try:
        # lazy: optional dependency of this package (transformers)
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:
        return False
    return getattr(fa_utils, "_is_packed_sequence", None) is _never_packed
