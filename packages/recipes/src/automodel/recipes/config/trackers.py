"""``wandb:`` and ``mlflow:`` (experiment trackers, NeMo AutoModel's keys): frozen sections that read
no disk and import no tracker package. The trackers themselves live in `automodel.recipes.trackers`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from automodel.recipes.errors import ConfigError

WANDB_MODES = ("online", "offline", "disabled")


def _string_list(key: str, value: list | None) -> None:
    if value is not None and not all(isinstance(v, str) for v in value):
        raise ConfigError(key, value, "must be a list of strings")


@dataclass(frozen=True)
class WandbSection:
    """Weights & Biases (``automodel-recipes[wandb]``). A ``wandb:`` section logs unless
    ``enable: false`` or ``mode: disabled``; ``mode`` null is wandb's own default (``WANDB_MODE``,
    else online). ``save_dir`` and ``dir`` (AutoModel's files use both) are the folder wandb writes
    its run files to (null: ``<output_dir>``)."""

    SECTION: ClassVar[str] = "wandb"
    enable: bool = True
    project: str | None = None
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: list | None = None
    notes: str | None = None
    mode: str | None = None
    save_dir: str | None = None
    dir: str | None = None

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in WANDB_MODES:
            raise ConfigError("wandb.mode", self.mode, f"must be one of {', '.join(WANDB_MODES)} (or null)")
        _string_list("wandb.tags", self.tags)
        if self.save_dir is not None and self.dir is not None and self.save_dir != self.dir:
            raise ConfigError(
                "wandb.dir", self.dir, f"differs from wandb.save_dir={self.save_dir!r}; give one"
            )

    @property
    def enabled(self) -> bool:
        return self.enable and self.mode != "disabled"

    @property
    def directory(self) -> str | None:
        return self.save_dir if self.save_dir is not None else self.dir

    @property
    def directory_key(self) -> str:
        return "wandb.save_dir" if self.save_dir is not None else "wandb.dir"


@dataclass(frozen=True)
class MlflowSection:
    """MLflow (``automodel-recipes[mlflow]``). ``tracking_uri`` null: ``MLFLOW_TRACKING_URI``, else
    ``sqlite:///<output_dir>/mlflow.db``; ``experiment_name`` null: ``automodel``;
    ``artifact_location`` null with a sqlite store: ``mlflow_artifacts/`` beside the database."""

    SECTION: ClassVar[str] = "mlflow"
    enable: bool = True
    tracking_uri: str | None = None
    experiment_name: str | None = None
    run_name: str | None = None
    tags: dict | None = None
    artifact_location: str | None = None

    def __post_init__(self) -> None:
        if self.tags is not None:
            bad = [k for k in self.tags if not isinstance(k, str)]
            if bad:
                raise ConfigError(f"mlflow.tags.{bad[0]}", self.tags[bad[0]], "tag names must be strings")

    @property
    def enabled(self) -> bool:
        return self.enable
