"""MLflow (``mlflow:``): one MLflow run per training run, through `mlflow.tracking.MlflowClient`
(no global active run); a resume continues the run whose id is kept in
``<output_dir>/trackers/mlflow_run_id``."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.config.trackers import MlflowSection
from automodel.recipes.errors import ConfigError
from automodel.recipes.trackers import TrackerKind, TrackerStart, register, writable_dir

#: ``mlflow.experiment_name`` null (MLflow's own ``Default`` experiment keeps its artifacts in ``./mlruns``)
DEFAULT_EXPERIMENT = "automodel"
#: seconds the pre-launch check waits for an http(s) tracking server to accept a connection
CONNECT_TIMEOUT_S = 5.0


def _section(cfg: RecipeConfig) -> MlflowSection | None:
    return cfg.mlflow if cfg.mlflow is not None and cfg.mlflow.enabled else None


def tracking_uri(section: MlflowSection, cfg: RecipeConfig) -> tuple[str, str]:
    """The URI and the key it comes from: ``mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI``,
    else ``sqlite:///<output_dir>/mlflow.db`` (MLflow 3 refuses new ``file:`` stores by default)."""
    if section.tracking_uri is not None:
        return section.tracking_uri, "mlflow.tracking_uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI"
    return f"sqlite:///{Path(cfg.output_dir).absolute() / 'mlflow.db'}", "output_dir"


def _file_store_allowed() -> bool:
    """MLflow >= 3.x refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE`` is true."""
    # lazy: optional dependency
    import mlflow.environment_variables as env

    flag = getattr(env, "MLFLOW_ALLOW_FILE_STORE", None)
    return flag is None or bool(flag.get())


def _check(section: MlflowSection, cfg: RecipeConfig) -> None:
    uri, key = tracking_uri(section, cfg)
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file"):
        writable_dir(key, uri, Path(parsed.path if scheme else uri), parents=False)
        if not _file_store_allowed():
            raise ConfigError(
                key,
                uri,
                "MLflow refuses file stores unless MLFLOW_ALLOW_FILE_STORE=true; use sqlite:///<path>.db",
            )
    elif scheme == "sqlite":
        try:
            # lazy: optional dependency
            import sqlalchemy  # noqa: F401
        except ImportError:
            raise ConfigError(
                key, uri, "a sqlite store needs sqlalchemy: pip install 'automodel-recipes[mlflow]'"
            ) from None
        database = uri.split("://", 1)[1][1:] if "://" in uri else ""  # sqlite:///rel.db, sqlite:////abs.db
        if database and database != ":memory:":
            folder = Path(database).parent
            if not folder.is_dir():
                raise ConfigError(key, uri, f"{folder.absolute()} is not an existing folder")
            writable_dir(key, uri, folder, parents=False)
    elif scheme in ("http", "https"):
        port = parsed.port or (443 if scheme == "https" else 80)
        try:
            with socket.create_connection((parsed.hostname or "localhost", port), timeout=CONNECT_TIMEOUT_S):
                pass
        except OSError as e:
            raise ConfigError(key, uri, f"is not reachable ({e.strerror or e})") from None
    # other schemes (databricks, ...): MLflow's own; the run's start reports their errors


def _flatten(node: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(node, dict):
        out: dict[str, str] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: str(node)[:6000]}


class MlflowTracker:
    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    def log(self, metrics: dict[str, float], *, step: int) -> None:
        # lazy: optional dependency
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()])

    def finish(self, *, checkpoint: str | None, failed: bool) -> None:
        if checkpoint is not None:
            self.client.set_tag(self.run_id, "checkpoint", checkpoint)
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _artifact_location(section: MlflowSection, uri: str) -> str | None:
    """``mlflow.artifact_location``; with a sqlite store, ``mlflow_artifacts/`` beside the database
    (MLflow's own default is ``./mlruns`` in the working directory); else the store's default."""
    if section.artifact_location is not None or urlparse(uri).scheme.lower() != "sqlite":
        return section.artifact_location
    database = uri.split("://", 1)[1][1:]
    return (Path(database).absolute().parent / "mlflow_artifacts").as_uri()


def _start(start: TrackerStart) -> tuple[MlflowTracker, str]:
    # lazy: optional dependency
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    section: MlflowSection = start.section
    uri, _ = tracking_uri(section, start.cfg)
    client = MlflowClient(tracking_uri=uri)
    if start.run_id is not None:
        run_id = start.run_id
        client.update_run(run_id, status="RUNNING")
    else:
        name = section.experiment_name or DEFAULT_EXPERIMENT
        experiment = client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(name, artifact_location=_artifact_location(section, uri))
        )
        tags = {str(k): str(v) for k, v in (section.tags or {}).items()}
        run_id = client.create_run(experiment_id, run_name=section.run_name, tags=tags).info.run_id
        params = [Param(k, v) for k, v in _flatten(start.cfg.raw).items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            client.log_batch(run_id, params=params[i : i + 100])
    client.log_dict(run_id, start.cfg.raw, "config.yaml")  # the config as this (re)start ran it
    return MlflowTracker(client, run_id), run_id


TRACKER = register(
    TrackerKind(name="mlflow", package="mlflow", extra="mlflow", section=_section, check=_check, start=_start)
)
