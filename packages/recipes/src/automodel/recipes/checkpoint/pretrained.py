"""Load a local Hugging Face safetensors directory straight into (sharded) parameters.

DCP's HF reader plans reads against this rank's DTensor shards and reads only those slices
from the safetensors files, so no rank materialises the full model when the layout shards it.

safetensors holds only tensors and a JSON header: reading it runs no code. Pickled weights
(``pytorch_model*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) are refused unless the YAML sets
``model.allow_pickle_weights: true``; even then they are read with ``torch.load(weights_only=True)``,
torch's restricted unpickler, and every rank reads the full files.
"""

from __future__ import annotations

import zipfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from automodel.recipes.checkpoint.converted_weights import SafetensorsReader, load_converted
from automodel.recipes.checkpoint.key_mapping import find_hf_model, plan_keys
from automodel.recipes.errors import ConfigError


def _tie_groups(part: nn.Module) -> dict[str, list[str]]:
    """Parameter name -> every name of the same (tied) parameter, in registration order. HF saves
    one name per tie, not necessarily the first one registered (CamemBERT saves the embedding, not
    the head that comes first)."""
    names: dict[int, list[str]] = {}
    for name, param in part.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name: group for group in names.values() for name in group}


PICKLE_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def _pickle_weight_files(directory: Path) -> list[Path]:
    return sorted({p for pattern in PICKLE_WEIGHT_PATTERNS for p in directory.glob(pattern) if p.is_file()})


def weight_files(directory: Path, *, allow_pickle_weights: bool) -> list[Path]:
    """The pickled weight files to read from `directory`, or [] when it holds ``*.safetensors``.

    The one home of the pickle rule, used by the load and by the pre-launch check
    (`run_files.check_model_dir`): only pickled weights and no `allow_pickle_weights` is a
    `ConfigError` naming the files and ``model.allow_pickle_weights``; no weights at all a `ValueError`.
    """
    if not directory.is_dir():
        raise ValueError(f"model directory {str(directory)!r} does not exist")
    if any(directory.glob("*.safetensors")):
        return []
    pickled = _pickle_weight_files(directory)
    if not pickled:
        raise ValueError(
            f"model directory {str(directory)!r} holds no weights (no *.safetensors files, nor pickled "
            f"{', '.join(PICKLE_WEIGHT_PATTERNS)} files)"
        )
    if not allow_pickle_weights:
        raise ConfigError(
            "model.allow_pickle_weights",
            False,
            f"model directory {str(directory)!r} holds only pickled weights "
            f"({', '.join(p.name for p in pickled[:4])}), which can run code when loaded; convert them "
            "to safetensors, or set model.allow_pickle_weights: true if you trust them "
            "(they are then read with torch.load(weights_only=True))",
        )
    return pickled


def load_pretrained_weights(
    model_parts: list[nn.Module],
    directory: str | Path,
    *,
    allow_pickle_weights: bool = False,
    optional_keys: Collection[str] = (),
) -> None:
    """Fill every parameter and persistent buffer of `model_parts` from HF weights in `directory`.

    Checkpoint keys map onto parameters as transformers' ``from_pretrained`` maps them (the model's
    conversion mapping: renamed modules, per-expert tensors stacked, fused projections).
    Collective: every rank calls it with its own parts. Tied weights absent from the files are
    left to the tie. Reads ``*.safetensors``; a directory holding only pickled weights
    (``*.bin``, ``*.pt``, ...) is refused unless `allow_pickle_weights` (YAML
    ``model.allow_pickle_weights``), and then read with ``torch.load(weights_only=True)``.
    Raises `ValueError` naming missing keys or a directory without loadable weights (`weight_files`).
    `optional_keys` may be absent from the files (LoRA adapters: they keep their initial values).
    """
    directory = Path(directory)
    pickled = weight_files(directory, allow_pickle_weights=allow_pickle_weights)
    if pickled:
        _load_pickled_weights(model_parts, directory, pickled, optional_keys)
        return
    reader = dcp.HuggingFaceStorageReader(path=str(directory))
    part_sds = [get_model_state_dict(part) for part in model_parts]
    targets = {k: v for sd in part_sds for k, v in sd.items()}
    hf_model = find_hf_model(model_parts)
    plan = plan_keys(hf_model, targets, reader.read_metadata().state_dict_metadata)
    _check_missing(model_parts, part_sds, plan.covered() | set(optional_keys), directory)
    # Tensors stored whole under a (possibly different) name: DCP reads only this rank's slices.
    dcp.load({source: targets[key] for key, source in plan.renamed.items()}, storage_reader=reader)
    if plan.converted:  # stacked experts, fused or split projections: transformers' converters
        load_converted(plan.converted, targets, read=SafetensorsReader(directory), hf_model=hf_model)
    for part, sd in zip(model_parts, part_sds):
        set_model_state_dict(part, sd)


def _load_pickled_weights(
    model_parts: list[nn.Module], directory: Path, files: list[Path], optional_keys: Collection[str] = ()
) -> None:
    """Opted-in path: every rank reads the full files with weights_only=True, then shards them."""
    full: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            loaded = torch.load(
                str(path), map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
            )
        except Exception as err:  # noqa: BLE001 - refused by the restricted unpickler or unreadable
            raise ValueError(
                f"model directory {str(directory)!r}: {path.name} cannot be read with "
                f"torch.load(weights_only=True) ({type(err).__name__}: {str(err).splitlines()[0]})"
            ) from None
        if not isinstance(loaded, dict) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
            raise ValueError(
                f"model directory {str(directory)!r}: {path.name} is not a state dict of tensors"
            )
        full.update(loaded)
    part_sds = [get_model_state_dict(part) for part in model_parts]
    hf_model = find_hf_model(model_parts)
    plan = plan_keys(hf_model, {k for sd in part_sds for k in sd}, full)
    _check_missing(model_parts, part_sds, plan.covered() | set(optional_keys), directory)
    options = StateDictOptions(full_state_dict=True)
    for part, sd in zip(model_parts, part_sds):
        # Every key of the part, in its own order, on every rank: distributing a full tensor to a
        # DTensor is a collective over that tensor's mesh. Tied keys absent from the files keep the tie.
        ties = _tie_groups(part)
        values: dict[str, Any] = {}
        for key, value in sd.items():
            source = next((plan.renamed[n] for n in ties.get(key, [key]) if n in plan.renamed), None)
            if source is not None:
                assert isinstance(value, torch.Tensor), key
                values[key] = full[source].to(value.dtype)
            else:
                values[key] = value.full_tensor() if isinstance(value, DTensor) else value
        set_model_state_dict(part, values, options=options)
    if plan.converted:
        targets = {k: v for sd in (get_model_state_dict(part) for part in model_parts) for k, v in sd.items()}
        load_converted(plan.converted, targets, read=full.__getitem__, hf_model=hf_model)


def _check_missing(
    model_parts: list[nn.Module], part_sds: list[dict[str, Any]], available: set[str], directory: Path
) -> None:
    missing: list[str] = []
    for part, sd in zip(model_parts, part_sds):
        ties = _tie_groups(part)
        missing += sorted(k for k in sd if not any(n in available for n in ties.get(k, [k])))
    if dist.is_initialized():
        # Every rank raises together; a lone raise would leave the others waiting in dcp.load.
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, missing)
        missing = sorted({k for m in everyone for k in m})
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(
            f"model directory {str(directory)!r} lacks {len(missing)} weights this model needs: {shown}"
        )
