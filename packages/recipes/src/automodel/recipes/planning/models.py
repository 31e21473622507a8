"""`recipes plan --model`: a config.json, a local model directory, a name or Hub id of the
configs shipped in examples/models/, or a Hub id already in the local HF cache (never downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from automodel.data.hub_cache import resolve_local_or_cached
from automodel.recipes.config.sections import ModelSection
from automodel.recipes.errors import ConfigError
from automodel.recipes.model import build_hf_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _example_dirs() -> list[Path]:
    here = Path(__file__).resolve()
    dirs = [Path.cwd() / "examples" / "models"]
    dirs += [p / "examples" / "models" for p in here.parents if (p / "examples" / "models").is_dir()]
    return [d for d in dict.fromkeys(dirs) if d.is_dir()]


def _load(*, source: str, **model_section: object) -> PretrainedConfig:
    """The config through the recipes' one loader (`model.build_hf_config`: model_type check, a
    directory's own code runs only with trust_remote_code), its error restated for --model."""
    try:
        return build_hf_config(ModelSection(**model_section), announce=False)
    except ConfigError as e:
        raise ConfigError("--model", source, f"{e.key}={e.value!r}: {e.message}") from None


def _from_dict(data: dict, *, source: str) -> Any:
    data = {k: v for k, v in data.items() if k != "_name_or_path"}
    if "model_type" not in data:
        raise ConfigError("--model", source, "has no model_type (it must be a transformers config.json)")
    return _load(source=source, config=data)


def known_models() -> dict[str, Path]:
    """Shipped configs by file stem and by the Hub id they describe (lower case)."""
    out: dict[str, Path] = {}
    for d in _example_dirs():
        for f in sorted(d.glob("*.json")):
            out.setdefault(f.stem.lower(), f)
            hub = json.loads(f.read_text()).get("_name_or_path")
            if hub:
                out.setdefault(hub.lower(), f)
    return out


def resolve_model_config(value: str) -> Any:
    """The transformers config `value` names (`ConfigError` naming --model otherwise)."""
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return _from_dict(json.loads(path.read_text()), source=value)
        except json.JSONDecodeError as e:
            raise ConfigError("--model", value, f"is not valid JSON ({e})") from None
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError("--model", value, "is a directory without config.json")
        return _load(source=value, pretrained_model_name_or_path=str(path))
    shipped = known_models().get(value.lower())
    if shipped is not None:
        return _from_dict(json.loads(shipped.read_text()), source=str(shipped))

    try:
        cached = resolve_local_or_cached(value, key="--model", required_file="config.json")
    except ConfigError:
        names = ", ".join(sorted(known_models()))
        raise ConfigError(
            "--model",
            value,
            f"is not a config.json, a model directory, a Hub id in the local cache, or a shipped config ({names})",
        ) from None
    return _load(source=value, pretrained_model_name_or_path=str(cached))
