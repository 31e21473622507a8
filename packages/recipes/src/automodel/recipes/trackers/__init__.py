"""Experiment trackers: rank 0 sends each tracker the records it writes to metrics.jsonl.

A tracker is one module and one `register` call (`wandb_tracker`, `mlflow_tracker`). Its `TrackerKind`
says which section enables it, which package and extra it needs, how to check before launch that it
can start (`check`: a folder or URI it cannot write refuses the run, naming the key and the value),
and how to start it (`start`, on rank 0, returns a `Tracker`).

Every started tracker gets: the run's config once (at start, from its own `start`), each step's
record (the finite numbers of the metrics.jsonl record, at the record's step) and, at the end, the
path of the consolidated checkpoint (or None). The run id is kept in ``<output_dir>/trackers/``:
a resumed run (one that restored a checkpoint) continues the same tracked run, and records of steps
the tracker already has (a run stopped past its last checkpoint) are not sent again.
"""

from __future__ import annotations

import importlib
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.errors import ConfigError

TRACKERS_DIR = "trackers"


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], *, step: int) -> None: ...

    def finish(self, *, checkpoint: str | None, failed: bool) -> None: ...


@dataclass(frozen=True)
class TrackerStart:
    """What `TrackerKind.start` is given: the section, the run's config, the run id to continue
    (None: a new tracked run) and the folder its files may use."""

    section: Any
    cfg: RecipeConfig
    run_id: str | None


@dataclass(frozen=True)
class TrackerKind:
    name: str  # the YAML section
    package: str  # the module it imports
    extra: str  # automodel-recipes[<extra>]
    #: the enabled section of this tracker in `cfg`, or None
    section: Callable[[RecipeConfig], Any]
    #: pre-launch: raise ConfigError naming the key when it cannot start on this machine
    check: Callable[[Any, RecipeConfig], None]
    #: on rank 0: start (or continue) the tracked run; returns it and its run id
    start: Callable[[TrackerStart], tuple[Tracker, str]]


_KINDS: dict[str, TrackerKind] = {}
_BUILTIN = ("automodel.recipes.trackers.wandb_tracker", "automodel.recipes.trackers.mlflow_tracker")


def register(kind: TrackerKind) -> TrackerKind:
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        raise ValueError(f"tracker {kind.name!r} is registered already")
    _KINDS[kind.name] = kind
    return kind


def registered() -> dict[str, TrackerKind]:
    for module in _BUILTIN:
        importlib.import_module(module)
    return dict(_KINDS)


def enabled(cfg: RecipeConfig) -> list[tuple[TrackerKind, Any]]:
    return [(kind, s) for kind in registered().values() if (s := kind.section(cfg)) is not None]


def check_trackers(cfg: RecipeConfig) -> None:
    """Before launch: every enabled tracker's package is installed and it can write where it logs."""
    for kind, section in enabled(cfg):
        try:
            importlib.import_module(kind.package)
        except ImportError:
            raise ConfigError(
                f"{kind.name}.enable",
                True,
                f"needs the {kind.package} package: pip install 'automodel-recipes[{kind.extra}]'",
            ) from None
        kind.check(section, cfg)


def writable_dir(key: str, value: str, path: Path, *, parents: bool = True) -> None:
    """`path` is a writable folder or can be created: its nearest existing parent (``parents=False``:
    its parent itself) is a folder where a file can be written (tried, so a read-only mount is found
    for root too); else ConfigError(key, value)."""
    folder = path.expanduser().absolute()
    if parents:
        while not folder.exists() and folder.parent != folder:
            folder = folder.parent
    elif not folder.exists():
        folder = folder.parent
        if not folder.exists():
            raise ConfigError(key, value, f"{folder} does not exist")
    if not folder.is_dir():
        raise ConfigError(key, value, f"{folder} is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".automodel-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(key, value, f"{folder} is not writable ({e.strerror or e})") from None


class _State:
    """``<output_dir>/trackers/<name>_run_id`` and ``<name>_last_step``."""

    def __init__(self, output_dir: str | Path, name: str) -> None:
        self.dir = Path(output_dir) / TRACKERS_DIR
        self.id_file = self.dir / f"{name}_run_id"
        self.step_file = self.dir / f"{name}_last_step"

    def run_id(self) -> str | None:
        return self.id_file.read_text().strip() or None if self.id_file.is_file() else None

    def last_step(self) -> int:
        try:
            return int(self.step_file.read_text())
        except (OSError, ValueError):
            return 0

    def save(self, *, run_id: str | None = None, last_step: int | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for path, value in ((self.id_file, run_id), (self.step_file, last_step)):
            if value is not None:
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(f"{value}\n")
                tmp.replace(path)


class _Started:
    def __init__(self, kind: TrackerKind, tracker: Tracker, state: _State, *, skip_through: int) -> None:
        self.kind, self.tracker, self.state, self.skip_through = kind, tracker, state, skip_through

    def log(self, record: dict[str, Any]) -> None:
        step = record["step"]
        if step <= self.skip_through:
            return  # the tracked run has this step already (logged before the checkpoint it resumed)
        metrics = {
            k: float(v)
            for k, v in record.items()
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        self.tracker.log(metrics, step=step)
        self.state.save(last_step=step)


class Trackers:
    """The started trackers of a run (rank 0); empty elsewhere and without a tracker section."""

    def __init__(self, started: list[_Started]) -> None:
        self.started = started

    @classmethod
    def start(cls, cfg: RecipeConfig, *, enabled_here: bool, resumed_step: int) -> Trackers:
        if not enabled_here:
            return cls([])
        started = []
        for kind, section in enabled(cfg):
            state = _State(cfg.output_dir, kind.name)
            # a fresh start (no checkpoint restored) is a new tracked run; a resume continues its own
            run_id = state.run_id() if resumed_step > 0 else None
            skip = max(resumed_step, state.last_step()) if run_id is not None else 0
            tracker, run_id = kind.start(TrackerStart(section=section, cfg=cfg, run_id=run_id))
            state.save(run_id=run_id, last_step=skip)
            started.append(_Started(kind, tracker, state, skip_through=skip))
        return cls(started)

    def log(self, record: dict[str, Any]) -> None:
        for s in self.started:
            s.log(record)

    def finish(self, *, checkpoint: str | None, failed: bool = False) -> None:
        started, self.started = self.started, []
        for s in started:
            s.tracker.finish(checkpoint=checkpoint, failed=failed)


__all__ = [
    "TRACKERS_DIR",
    "Tracker",
    "TrackerKind",
    "TrackerStart",
    "Trackers",
    "check_trackers",
    "enabled",
    "register",
    "registered",
    "writable_dir",
]
