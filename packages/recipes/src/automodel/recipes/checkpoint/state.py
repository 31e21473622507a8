"""`TrainingState` and its conversion to and from one resharding-friendly DCP state dict.

Model and optimizer state are keyed by parameter FQN (optimizer state flattened), so a
checkpoint written by one layout (FSDP2 dp=4, TP=2, PP stages on different ranks) loads into
any other: DCP matches keys and re-slices DTensor shards. Per-rank state (step, LR schedulers,
dataloader position, RNG) goes under ``extra_rank<r>``: its plain values as JSON text (stored as a
uint8 tensor), RNG states and any other tensors as tensor entries. Nothing here is pickled, so
loading a checkpoint someone else wrote runs no code from it (see `safe_dcp` for DCP's own files).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from automodel.recipes.lr_schedule import restore_lr_scheduler

if TYPE_CHECKING:  # strategies -> planning -> peft -> checkpoint: the type only
    from automodel.recipes.strategies.base import PartWrapping

MODEL_KEY = "model"
OPTIM_KEY = "optim"
EXTRA_PREFIX = "extra_rank"


@dataclass
class TrainingState:
    """Everything a resumed run needs; the loop owns it, the `Checkpointer` reads and fills it.

    `model_parts` are this rank's modules (one per PP stage it holds, else one); `optimizers`
    pair with them one-to-one (or are empty). `dataloader` needs ``state_dict()`` and
    ``load_state_dict()``; its state should describe the global position so it survives a
    change of layout. `step` is the number of optimizer steps done.
    """

    model_parts: list[nn.Module]
    optimizers: list[Any]
    lr_schedulers: list[Any]
    dataloader: Any
    step: int
    hf_config: Any = None
    tokenizer: Any = None
    #: The strategy that wrapped `model_parts`: their state dicts and optimizer-state modules
    #: (`strategies.base.PLAIN_PARTS` for parts no strategy wrapped).
    strategy: PartWrapping = field(kw_only=True)

    def __post_init__(self) -> None:
        if not self.model_parts:
            raise ValueError("TrainingState.model_parts must hold at least one module, got []")
        if self.optimizers and len(self.optimizers) != len(self.model_parts):
            raise ValueError(
                f"TrainingState.optimizers must pair with model_parts one-to-one: "
                f"{len(self.optimizers)} optimizers for {len(self.model_parts)} model parts"
            )
        if not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"TrainingState.step must be an integer >= 0, got {self.step!r}")


_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state_dict(model_parts: list[nn.Module], *, strategy: PartWrapping) -> dict[str, Any]:
    """FQN -> (sharded) tensor over all parts of this rank."""
    merged: dict[str, Any] = {}
    for part in model_parts:
        merged.update(strategy.model_state_dict(part))
    return merged


def _optim_state_dict(state: TrainingState) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for part, opt in zip(state.model_parts, state.optimizers):
        merged.update(
            get_optimizer_state_dict(state.strategy.state_module(part), opt, options=_OPTIM_OPTIONS)
        )
    return merged


def _rng_state() -> dict[str, Any]:
    """This process's RNG states: generator states as tensors, their few scalars as plain values."""
    version, mt, gauss_next = random.getstate()
    rng: dict[str, Any] = {
        "python": {
            "version": version,
            "state": torch.tensor(mt, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    rng["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return rng


def _set_rng_state(rng: dict[str, Any]) -> None:
    py = rng["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    torch.set_rng_state(rng["torch"].to(torch.uint8))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"].to(torch.uint8))
    if "numpy" in rng:
        st = rng["numpy"]
        keys = st["keys"].numpy().astype(np.uint32)
        np.random.set_state((st["kind"], keys, st["pos"], st["has_gauss"], st["cached_gaussian"]))


# ---- plain values as JSON, tensors as DCP tensor entries ---------------------------------
# One rank's extra state is saved as ``extra_rank<r>.json`` (the UTF-8 JSON text as a uint8
# tensor) plus ``extra_rank<r>.t<i>`` for each tensor found in it; the JSON names them with
# ``{"__tensor__": i}`` and keeps tuples as ``{"__tuple__": [...]}``. No pickle anywhere: the
# JSON is parsed with `json.loads`, the tensors are read by DCP with ``weights_only=True``.
JSON_ENTRY = "json"
_TENSOR_MARK = "__tensor__"
_TUPLE_MARK = "__tuple__"


def _encode(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach().to("cpu").clone())
        return {_TENSOR_MARK: len(tensors) - 1}
    if isinstance(value, tuple):
        return {_TUPLE_MARK: [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ValueError(f"training state {where} has a non-string key: {list(value)!r}")
        if len(value) == 1 and next(iter(value)) in (_TENSOR_MARK, _TUPLE_MARK):
            raise ValueError(f"training state {where} uses the reserved key {next(iter(value))!r}")
        return {k: _encode(v, tensors, f"{where}.{k}") for k, v in value.items()}
    raise ValueError(
        f"training state {where} is a {type(value).__name__}, which a checkpoint cannot hold without pickle "
        "(use numbers, strings, lists, dicts and tensors)"
    )


def _decode(value: Any, tensors: dict[int, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TENSOR_MARK in value:
            return tensors[int(value[_TENSOR_MARK])]
        if len(value) == 1 and _TUPLE_MARK in value:
            return tuple(_decode(v, tensors) for v in value[_TUPLE_MARK])
        return {k: _decode(v, tensors) for k, v in value.items()}
    return value


def encode_extra(extra: dict[str, Any]) -> dict[str, torch.Tensor]:
    """`extra` as DCP tensor entries: ``json`` (uint8 UTF-8 JSON) and ``t<i>`` tensors."""
    tensors: list[torch.Tensor] = []
    text = json.dumps(_encode(extra, tensors, "extra"), allow_nan=True)
    out = {JSON_ENTRY: torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).clone()}
    out.update({f"t{i}": t for i, t in enumerate(tensors)})
    return out


def decode_extra(entries: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Inverse of `encode_extra`."""
    text = entries[JSON_ENTRY].to(torch.uint8).numpy().tobytes().decode("utf-8")
    tensors = {int(k[1:]): v for k, v in entries.items() if k != JSON_ENTRY}
    return _decode(json.loads(text), tensors)


def _extra_state(state: TrainingState) -> dict[str, torch.Tensor]:
    extra = {
        "step": state.step,
        "lr_schedulers": [s.state_dict() for s in state.lr_schedulers],
        "dataloader": state.dataloader.state_dict() if state.dataloader is not None else None,
        "rng": _rng_state(),
    }
    return encode_extra(extra)


def extra_placeholders(metadata: Metadata, extra_key: str) -> dict[str, torch.Tensor]:
    """Empty tensors shaped like the saved ``<extra_key>.*`` entries, for ``dcp.load`` to fill."""
    out: dict[str, torch.Tensor] = {}
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(f"{extra_key}.") and isinstance(md, TensorStorageMetadata):
            out[key[len(extra_key) + 1 :]] = torch.empty(md.size, dtype=md.properties.dtype)
    return out


def has_extra(metadata: Metadata, extra_key: str) -> bool:
    """True when the checkpoint holds this format's ``<extra_key>.json`` entry."""
    md = metadata.state_dict_metadata.get(f"{extra_key}.{JSON_ENTRY}")
    return isinstance(md, TensorStorageMetadata)


def has_legacy_extra(metadata: Metadata, extra_key: str) -> bool:
    """True for the old format: one pickled bytes entry ``<extra_key>`` (never unpickled here)."""
    return isinstance(metadata.state_dict_metadata.get(extra_key), BytesStorageMetadata)


def build_save_state(state: TrainingState) -> dict[str, Any]:
    """The DCP state dict to save for this rank."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sd: dict[str, Any] = {MODEL_KEY: model_state_dict(state.model_parts, strategy=state.strategy)}
    if state.optimizers:
        sd[OPTIM_KEY] = _optim_state_dict(state)
    sd[f"{EXTRA_PREFIX}{rank}"] = _extra_state(state)
    return sd


def build_load_state(
    state: TrainingState, *, metadata: Metadata, extra_key: str, with_optim: bool
) -> dict[str, Any]:
    """Placeholders shaped like this rank's state, for ``dcp.load`` to fill in place."""
    sd: dict[str, Any] = {MODEL_KEY: model_state_dict(state.model_parts, strategy=state.strategy)}
    if with_optim and state.optimizers:
        sd[OPTIM_KEY] = _optim_state_dict(state)
    sd[extra_key] = extra_placeholders(metadata, extra_key)
    return sd


def apply_loaded_state(
    state: TrainingState, loaded: dict[str, Any], *, extra_key: str, restore_rng: bool
) -> None:
    """Push a filled state dict into the modules, optimizers, schedulers, dataloader and RNG."""
    wrapping = state.strategy
    for part in state.model_parts:
        keys = wrapping.model_state_dict(part).keys()
        set_model_state_dict(wrapping.state_module(part), {k: loaded[MODEL_KEY][k] for k in keys})
    if OPTIM_KEY in loaded:
        for part, opt in zip(state.model_parts, state.optimizers):
            module = wrapping.state_module(part)
            keys = get_optimizer_state_dict(module, opt, options=_OPTIM_OPTIONS).keys()
            set_optimizer_state_dict(
                module, opt, {k: loaded[OPTIM_KEY][k] for k in keys}, options=_OPTIM_OPTIONS
            )
    extra = decode_extra(loaded[extra_key])
    saved_scheds = extra["lr_schedulers"]
    if state.lr_schedulers and not saved_scheds:
        raise ValueError("the checkpoint holds no LR scheduler state but this run has LR schedulers")
    # Every stage's scheduler follows the same schedule: the first saved one stands for all,
    # so a checkpoint from a different PP layout (other scheduler count) still restores.
    for sched in state.lr_schedulers:
        restore_lr_scheduler(sched, saved_scheds[0])
    if state.dataloader is not None and extra["dataloader"] is not None:
        state.dataloader.load_state_dict(extra["dataloader"])
    if restore_rng:
        _set_rng_state(extra["rng"])
    state.step = int(extra["step"])
