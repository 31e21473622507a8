"""Read a recipe YAML and apply `--section.key=value` overrides typed like YAML values."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from automodel.recipes.errors import ConfigError

#: YAML 1.1 (PyYAML) reads a float only with a dot and a signed exponent (``1.0e-5``), so ``1e-8``,
#: ``5e-3`` and ``1E+4`` would be strings; YAML 1.2 and every AutoModel recipe mean numbers.
_FLOAT = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class RecipeYamlLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that reads ``1e-8`` as a number (the one YAML reader of recipes)."""


RecipeYamlLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:float"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
RecipeYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """Parse recipe YAML text (files and ``--key=value`` override values alike)."""
    return yaml.load(text, Loader=RecipeYamlLoader)  # noqa: S506 - a SafeLoader subclass


def parse_override(arg: str) -> tuple[list[str], Any]:
    """`--a.b=3` -> (["a", "b"], 3); the value is parsed as recipe YAML (so `true`, `1e-3`, `[1, 2]` work)."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body:
        raise ConfigError(arg, None, "override must look like --section.key=value")
    dotted, raw = body.split("=", 1)
    path = dotted.split(".")
    if not dotted or any(not p for p in path):
        raise ConfigError(arg, raw, "override key must be a dotted path like section.key")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(dotted, raw, f"value is not valid YAML ({type(e).__name__})") from None
    return path, value


def apply_overrides(config: dict, overrides: list[str]) -> dict:
    """Set each dotted key in (a copy of) `config`; intermediate sections are created as needed."""
    out = copy.deepcopy(config)
    for arg in overrides:
        path, value = parse_override(arg)
        node = out
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    ".".join(path[: i + 1]), child, "is not a section, cannot set a key inside it"
                )
            node = child
        node[path[-1]] = value
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> dict:
    """The YAML mapping at `path` with `overrides` applied; unreadable or non-mapping files are errors."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", str(path), "no such file")
    try:
        data = load_yaml(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError("config", str(path), f"is not valid YAML{where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            "config", str(path), f"must be a YAML mapping of sections, got {type(data).__name__}"
        )
    data = apply_overrides(data, overrides or [])
    if "output_dir" not in data:
        data["output_dir"] = str(Path("runs") / p.stem)
    return data
