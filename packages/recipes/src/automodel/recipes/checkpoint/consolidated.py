"""Consolidated Hugging Face export: full tensors, HF file names, ``config.json``, tokenizer.

Each parameter is gathered to full size by the ranks that hold it (a collective over its own
mesh, so PP stages gather independently) and written by the lowest rank holding it; one file
per writer, plus the HF index when there is more than one. Keys and shapes are those
transformers' ``save_pretrained`` writes: the model's FQNs passed through the reverse of its
conversion mapping (Mixtral's stacked experts become per-expert ``w1``/``w3``/``w2``, GPT-NeoX's
``lm_head`` becomes ``embed_out``), so ``from_pretrained``, serving engines and the model's Hub
tooling read the directory with no code of ours.

With `lora_scales` (a LoRA run with ``peft.save_merged: true``) the adapters are not written:
each adapted linear's weight is written merged, ``W + scale * B @ A``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from automodel.recipes.checkpoint.key_mapping import find_hf_model, to_checkpoint_layout
from automodel.recipes.peft.lora import merged_weight

if TYPE_CHECKING:  # strategies -> planning -> peft -> checkpoint: the type only
    from transformers import PretrainedConfig

    from automodel.recipes.strategies.base import PartWrapping

_FILE_NAMES = {
    "safetensors": (
        "model.safetensors",
        "model-{i:05d}-of-{n:05d}.safetensors",
        "model.safetensors.index.json",
    ),
    "torch_save": (
        "pytorch_model.bin",
        "pytorch_model-{i:05d}-of-{n:05d}.bin",
        "pytorch_model.bin.index.json",
    ),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def save_consolidated(
    *,
    model_parts: list[nn.Module],
    directory: Path,
    model_save_format: str,
    hf_config: PretrainedConfig = None,
    tokenizer: Any = None,
    lora_scales: Mapping[str, float] | None = None,
    strategy: PartWrapping,
) -> list[str]:
    """Write this rank's share of the consolidated checkpoint; collective over all ranks.

    `strategy`: the one that wrapped `model_parts` (their state dicts and full tensors).

    `lora_scales` (adapted linear FQN -> alpha / dim) merges LoRA adapters into their weights.
    Returns the file names written by all ranks (the same list on every rank).
    """
    lora_scales = lora_scales or {}

    def adapted(key: str) -> tuple[str, str] | None:
        module, _, leaf = key.rpartition(".")  # <linear>.lora_A / weight
        base, _, which = module.rpartition(".")
        return (
            (base, which)
            if leaf == "weight" and which in ("lora_A", "lora_B") and base in lora_scales
            else None
        )

    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local: dict[str, Any] = {}
    owner: dict[str, nn.Module] = {}
    hf_model = find_hf_model(model_parts)
    # Tied copies (an LM head tied to the embedding) are written once, under the source's name, as
    # save_pretrained does; from_pretrained ties them again. Every rank drops the same keys.
    tied_copies = set(getattr(hf_model, "all_tied_weights_keys", None) or {})
    for part in model_parts:
        part_sd = {k: v for k, v in strategy.model_state_dict(part).items() if k not in tied_copies}
        local.update(part_sd)
        owner.update(dict.fromkeys(part_sd, part))
    sizes = {k: _nbytes(v) for k, v in local.items() if adapted(k) is None}
    gathered: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, sizes)
    else:
        gathered = [sizes]
    writer_of: dict[str, int] = {}
    total_size = 0
    for r, rank_sizes in enumerate(gathered):
        for key, nbytes in rank_sizes.items():
            if key not in writer_of:
                writer_of[key] = r
                total_size += nbytes
    writers = sorted(set(writer_of.values()))
    single, pattern, index_name = _FILE_NAMES[model_save_format]
    file_of_writer = {
        w: single if len(writers) == 1 else pattern.format(i=i + 1, n=len(writers))
        for i, w in enumerate(writers)
    }

    mine: dict[str, torch.Tensor] = {}
    adapters: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in local.items():
        full = strategy.full_tensor(value, owner[key])
        lora = adapted(key)
        if lora is not None:  # the writer of the linear's weight holds its adapters too (same part)
            adapters.setdefault(lora[0], {})[lora[1]] = full.detach()
            continue
        if writer_of[key] == rank:
            # Own storage per key: safetensors refuses shared (tied) tensors.
            mine[key] = full.detach().to("cpu").contiguous().clone()
        del full
    if adapters:
        for base, ab in adapters.items():
            if f"{base}.weight" in mine:
                mine[f"{base}.weight"] = merged_weight(
                    mine[f"{base}.weight"], ab["lora_A"], ab["lora_B"], scale=lora_scales[base]
                )
    mine = _own_storage(to_checkpoint_layout(hf_model, mine))
    written: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(written, sorted(mine))
    else:
        written = [sorted(mine)]
    if rank in file_of_writer:
        _write(mine, directory / file_of_writer[rank], model_save_format)
    del mine

    if rank == 0:
        if len(writers) > 1:
            index = {
                "metadata": {"total_size": total_size},
                "weight_map": {k: file_of_writer[r] for r in writers for k in sorted(written[r])},
            }
            (directory / index_name).write_text(json.dumps(index, indent=2) + "\n")
        config = hf_config if hf_config is not None else getattr(model_parts[0], "config", None)
        if config is not None:
            config.save_pretrained(str(directory))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(directory))
    files = sorted(file_of_writer.values())
    if len(writers) > 1:
        files.append(index_name)
    return files


def _own_storage(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor contiguous in a storage of its own: safetensors refuses views of one storage
    (the per-expert slices of a stacked tensor are such views)."""
    out = {}
    for key, t in tensors.items():
        t = t.contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        out[key] = t
    return out


def _write(tensors: dict[str, torch.Tensor], path: Path, model_save_format: str) -> None:
    if model_save_format == "safetensors":
        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        torch.save(tensors, str(path))
