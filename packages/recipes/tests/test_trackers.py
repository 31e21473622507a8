"""`wandb:` and `mlflow:` (trackers/): the real packages, no network (wandb offline, a local MLflow
file store). What they hold equals metrics.jsonl; a resume continues the same tracked run; a tracker
that cannot start is refused before launch, naming the key and the value."""

from __future__ import annotations

import json
import socket
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from automodel.recipes.cli import run_cli
from automodel.recipes.metrics import read_metrics

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402

#: the metrics.jsonl keys a tracker gets (every number of the record but the step)
TRACKED = (
    "loss",
    "grad_norm",
    "lr",
    "num_tokens",
    "tokens_per_s",
    "step_time_s",
    "peak_mem_bytes",
    "val_loss",
)


def wandb_records(path: Path) -> list[Any]:
    """The records of a ``run-<id>.wandb`` file, parsed with wandb's own protobuf classes.

    The file is wandb's LevelDB-style log (wandb >= 0.2x has no Python reader of it any more): a
    7-byte header (``:W&B``, version), then 32 KiB blocks of chunks, each a 7-byte header (crc32,
    length, type: full / first / middle / last) and its bytes."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()  # pyright: ignore[reportAttributeAccessIssue]  (generated protobuf)
            record.ParseFromString(pending)
            out.append(record)
    return out


def read_wandb(directory: Path) -> dict[str, Any]:
    """Every offline run under `directory`: run ids, history rows by step (a step twice fails),
    the config, the summary's checkpoint."""
    files = sorted(directory.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, list(directory.rglob("*"))
    ids, history, config, summary = set(), {}, {}, {}
    for f in files:
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                ids.add(r.run.run_id)
                config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                step = row.pop("_step")
                assert step not in history, f"step {step} logged twice"
                history[step] = {k: v for k, v in row.items() if not k.startswith("_")}
            elif kind == "summary":
                summary.update(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.summary.update}
                )
    return {"ids": ids, "history": history, "config": config, "summary": summary, "files": len(files)}


def read_mlflow(uri: str) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1, runs
    run = runs[0]
    history: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        points = client.get_metric_history(run.info.run_id, key)
        steps = [p.step for p in points]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice: {steps}"
        for p in points:
            history.setdefault(p.step, {})[key] = p.value
    return {"run": run, "history": history, "client": client}


def expected(out: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: {k: float(r[k]) for k in TRACKED if r.get(k) is not None} for r in read_metrics(out)}


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_home"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "wandb_runs"


def test_trackers_log_metrics_jsonl_and_a_resume_appends(tmp_path: Path, offline_wandb: Path) -> None:
    """`recipes train` (the CLI, in process) with both trackers, 3 steps, then resumed to 5."""
    out = tmp_path / "run"
    mlruns = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(
        str(out),
        step_scheduler={"max_steps": 3, "val_every_steps": 2, "ckpt_every_steps": 3},
        checkpoint={"enabled": True, "save_consolidated": True},
        wandb={"project": "tiny", "name": "tracked", "tags": ["t"], "save_dir": str(offline_wandb)},
        mlflow={"tracking_uri": mlruns, "experiment_name": "tiny", "run_name": "tracked", "tags": {"k": "v"}},
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert run_cli(["train", str(path)]) == 0
    first = read_wandb(offline_wandb)
    run_id = (out / "trackers" / "wandb_run_id").read_text().strip()
    assert first["ids"] == {run_id} and sorted(first["history"]) == [1, 2, 3]
    assert first["history"] == expected(out)

    assert run_cli(["train", str(path), "--step_scheduler.max_steps=5"]) == 0
    want = expected(out)
    assert sorted(want) == [1, 2, 3, 4, 5] and "val_loss" in want[2] and "val_loss" in want[5]
    tracked = read_wandb(offline_wandb)
    assert tracked["files"] == 2 and tracked["ids"] == {run_id}  # the same run, continued
    assert tracked["history"] == want
    assert tracked["config"]["step_scheduler"]["val_every_steps"] == 2
    assert tracked["config"]["wandb"]["project"] == "tiny"
    from automodel.recipes.checkpoint.paths import CONSOLIDATED_DIR, checkpoint_root, step_dir_name

    final = checkpoint_root(checkpoint_dir=None, output_dir=out) / step_dir_name(5) / CONSOLIDATED_DIR
    assert tracked["summary"]["checkpoint"] == str(final) and final.is_dir(), tracked["summary"]

    ml = read_mlflow(mlruns)
    assert ml["run"].info.run_id == (out / "trackers" / "mlflow_run_id").read_text().strip()
    assert ml["run"].info.run_name == "tracked" and ml["run"].data.tags["k"] == "v"
    assert ml["run"].info.status == "FINISHED"
    assert ml["history"] == want
    assert ml["run"].data.tags["checkpoint"] == tracked["summary"]["checkpoint"]
    assert ml["run"].data.params["step_scheduler.val_every_steps"] == "2"
    config = ml["client"].download_artifacts(ml["run"].info.run_id, "config.yaml", str(tmp_path))
    assert yaml.safe_load(Path(config).read_text())["step_scheduler"]["max_steps"] == 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture, **sections: Any) -> str:
    out = tmp_path / "run"
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(tiny_config(str(out), **sections)))
    code = run_cli(["train", str(path)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(err) == 1, err
    assert not out.exists()
    return err[0]


def test_missing_package_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("wandb", "mlflow"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
        line = _refused(tmp_path, capsys, **{name: {"enable": True}})
        assert (
            line
            == f"error: {name}.enable=True: needs the {name} package: pip install 'automodel-recipes[{name}]'"
        )
        monkeypatch.delitem(sys.modules, name)


def test_unwritable_or_unreachable_tracking_uri_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "a_file").write_text("")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    cases = {
        "file:/nonexistent-ro/deeper/mlruns": "/nonexistent-ro/deeper does not exist",
        f"sqlite:///{tmp_path}/nonexistent/mlflow.db": "nonexistent is not an existing folder",
        f"file:{tmp_path}/mlruns": "MLflow refuses file stores unless MLFLOW_ALLOW_FILE_STORE=true",
        f"file:{tmp_path}/a_file/mlruns": "is not a folder",
        f"http://127.0.0.1:{_free_port()}": "is not reachable",
    }
    for uri, why in cases.items():
        line = _refused(tmp_path, capsys, mlflow={"tracking_uri": uri})
        assert line.startswith(f"error: mlflow.tracking_uri={uri!r}: ") or line.startswith(
            f"error: mlflow.tracking_uri={uri}: "
        ), line
        assert why in line, line
    line = _refused(tmp_path, capsys, wandb={"save_dir": f"{tmp_path}/a_file/wandb", "mode": "offline"})
    assert line.startswith("error: wandb.save_dir=") and "is not a folder" in line, line


def test_wandb_mode_must_be_known(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    line = _refused(tmp_path, capsys, wandb={"mode": "sometimes"})
    assert line.startswith("error: wandb.mode='sometimes': must be one of online, offline, disabled"), line


def test_automodel_file_with_wandb_enabled_trains_and_logs(tmp_path: Path, offline_wandb: Path) -> None:
    """An AutoModel recipe (its keys, as its example files write them) with ``wandb.enable: true``
    is no longer refused: `recipes train` runs it (wandb offline here) and wandb gets every record."""
    from automodel.testing.tiny_model import tiny_llama

    sys.path.insert(0, str(Path(__file__).parent))
    from test_automodel_compat import PREFIX, automodel_base

    tiny_llama(max_position_embeddings=128).save_pretrained(tmp_path / "tiny-llama")
    rows = [
        {"context": f"Ada has {i % 9} cats.", "question": "How many?", "answers": {"text": [str(i % 9)], "answer_start": [8]}}
        for i in range(32)
    ]  # fmt: skip
    (tmp_path / "squad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = automodel_base(str(tmp_path / "tiny-llama"))
    raw["output_dir"] = str(tmp_path / "run")
    raw["dataset"] = {"_target_": PREFIX + "squad.make_squad_dataset", "dataset_name": str(tmp_path / "squad.jsonl"), "split": "train", "seq_length": 64}  # fmt: skip
    raw["step_scheduler"] = {**raw["step_scheduler"], "max_steps": 3, "log_remote_every_steps": 1}
    raw["wandb"] = {
        "enable": True,
        "project": "automodel-tiny",
        "entity": "<your_wandb_entity>",
        "name": "tiny_squad",
        "dir": str(offline_wandb),  # AutoModel's key for wandb's folder
    }
    path = tmp_path / "automodel.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert run_cli(["train", str(path)]) == 0
    tracked = read_wandb(offline_wandb)
    assert sorted(tracked["history"]) == [1, 2, 3]
    assert tracked["history"] == expected(tmp_path / "run")
    assert tracked["config"]["wandb"]["name"] == "tiny_squad"


def test_resume_after_steps_past_the_checkpoint_logs_no_step_twice(
    tmp_path: Path, offline_wandb: Path
) -> None:
    """A run that stopped after step 3 with its last checkpoint at step 2 (the step_3 directory
    removed): the resume reruns step 3 into metrics.jsonl, and the trackers, which have step 3
    already, get steps 4 and 5 only (one value per step; the rerun's step 3 is not sent)."""
    import shutil

    from automodel.recipes.checkpoint.paths import checkpoint_root, step_dir_name

    out = tmp_path / "run"
    mlruns = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = tiny_config(
        str(out),
        step_scheduler={"max_steps": 3, "val_every_steps": None, "ckpt_every_steps": 2},
        validation_dataset=None,
        checkpoint={"enabled": True},
        wandb={"save_dir": str(offline_wandb)},
        mlflow={"tracking_uri": mlruns},
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert run_cli(["train", str(path)]) == 0
    first = expected(out)
    shutil.rmtree(checkpoint_root(checkpoint_dir=None, output_dir=out) / step_dir_name(3))
    assert run_cli(["train", str(path), "--step_scheduler.max_steps=5"]) == 0
    want = expected(out)
    assert sorted(want) == [1, 2, 3, 4, 5]
    for tracked in (read_wandb(offline_wandb)["history"], read_mlflow(mlruns)["history"]):
        assert sorted(tracked) == [1, 2, 3, 4, 5]
        assert tracked[3] == first[3]  # the first attempt's step 3
        assert {s: tracked[s] for s in (1, 2, 4, 5)} == {s: want[s] for s in (1, 2, 4, 5)}


@pytest.mark.slow
def test_quickstart_cli_two_ranks_with_both_trackers(tmp_path: Path) -> None:
    """`recipes train examples/quickstart.yaml --nproc-per-node=2` in a child process (torchrun),
    the trackers added by command-line overrides: rank 0 logs what metrics.jsonl has, and MLflow's
    files stay beside its database (none in the working directory)."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[3]
    out, wb, db = tmp_path / "run", tmp_path / "wandb_runs", tmp_path / "mlflow.db"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wbh")}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [
        sys.executable, "-m", "automodel.recipes.cli", "train", str(root / "examples" / "quickstart.yaml"),
        "--nproc-per-node=2", f"--output_dir={out}", "--step_scheduler.max_steps=4",
        "--step_scheduler.val_every_steps=2", "--logging.progress_bar=false", "--checkpoint.enabled=false",
        "--wandb.project=quickstart", f"--wandb.save_dir={wb}", f"--mlflow.tracking_uri=sqlite:///{db}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = expected(out)
    assert sorted(want) == [1, 2, 3, 4] and "val_loss" in want[2]
    assert read_wandb(wb)["history"] == want
    ml = read_mlflow(f"sqlite:///{db}")
    assert ml["history"] == want
    assert ml["run"].info.artifact_uri.startswith((tmp_path / "mlflow_artifacts").as_uri())
    assert not (tmp_path / "mlruns").exists()
