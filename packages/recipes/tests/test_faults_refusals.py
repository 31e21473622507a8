"""Refusals reach the user as one line with exit code 2, and nothing is lost.

Before launch (`preflight.check_run_files`, in the one pre-launch check): a model directory,
checkpoint or data file that is unreadable, truncated or of the wrong kind is refused naming the
file and the key (or column). These run `run_cli` in-process: the same `recipes train` path as the
console script, whose exit code is `run_cli`'s (`test_pickled_weights_console_script` runs one case
as the real command). Inside the ranks: a `ValueError` automodel code raises itself is one line and
exit 2 (`errors.is_user_error`), one torch raises keeps its traceback.

Root reads a mode-000 file, so the permission cases drop the effective uid to ``nobody`` around
the check (`_as_nobody`); the kinds that stop root too are tested as root: a directory where a file
is expected, a FIFO, a dangling symbolic link.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import Metadata
from transformers import AutoConfig

from automodel.recipes.cli import _run_guarded, run_cli
from automodel.recipes.errors import is_user_error
from automodel.recipes.rank_errors import EXIT_RUN_ERROR, EXIT_USER_ERROR, classify
from automodel.testing.tiny_model import TINY_SIZES

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))
from _launch_helpers import clean_env  # noqa: E402
from _recipe_helpers import tiny_config  # noqa: E402

from automodel.testing.faults import full_only  # noqa: E402

NOBODY = 65534


def _config(tmp: Path, **sections: Any) -> Path:
    cfg = tiny_config(str(tmp / "run"), validation_dataset=None, step_scheduler={"max_steps": 2})
    for key, value in sections.items():
        if key == "model":
            cfg["model"] = value  # a pretrained directory replaces model.config
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _refused(config: Path, capsys: pytest.CaptureFixture) -> str:
    """`recipes train config`: exit 2, stderr one ``error:`` line (returned), no output_dir."""
    assert run_cli(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not (config.parent / "run").exists()  # nothing written: refused before launch
    return err[0]


def _model_dir(tmp: Path, *, weights: bool = True) -> Path:
    d = tmp / "model"
    AutoConfig.for_model("llama", **TINY_SIZES).save_pretrained(d)
    if weights:
        save_file({"lm_head.weight": torch.zeros(4, 4)}, d / "model.safetensors")
    return d


def _pretrained(d: Path, **extra: Any) -> dict[str, Any]:
    return {"model": {"pretrained_model_name_or_path": str(d), **extra}}


@contextmanager
def _as_nobody() -> Iterator[None]:
    """Root reads any file whatever its mode: check as ``nobody`` (effective ids only, restored)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A folder ``nobody`` may enter (pytest's tmp_path is under a 0700 root folder)."""
    d = Path(tempfile.mkdtemp(prefix="refusals-"))
    d.chmod(0o755)
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


# ---- the model directory ----------------------------------------------------------------------------
class TestModelDirectory:
    def test_pickled_weights_only(self, tmp_path, capsys):
        d = _model_dir(tmp_path, weights=False)
        torch.save({"lm_head.weight": torch.zeros(4, 4)}, d / "pytorch_model.bin")
        line = _refused(_config(tmp_path, **_pretrained(d)), capsys)
        assert line.startswith("error: model.allow_pickle_weights=False: model directory")
        assert "pytorch_model.bin" in line and str(d) in line

    def test_no_weights(self, tmp_path, capsys):
        d = _model_dir(tmp_path, weights=False)
        line = _refused(_config(tmp_path, **_pretrained(d)), capsys)
        assert f"model.pretrained_model_name_or_path='{d}'" in line and "holds no weights" in line

    def test_truncated_safetensors(self, tmp_path, capsys):
        d = _model_dir(tmp_path)
        f = d / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-10])
        line = _refused(_config(tmp_path, **_pretrained(d)), capsys)
        assert f"{f} is truncated or corrupt" in line and "model.pretrained_model_name_or_path" in line

    def test_not_a_safetensors_file(self, tmp_path, capsys):
        d = _model_dir(tmp_path)
        (d / "model.safetensors").write_bytes(b"PK\x03\x04 a zip, not safetensors" * 4)
        line = _refused(_config(tmp_path, **_pretrained(d)), capsys)
        assert f"{d / 'model.safetensors'} is not a readable safetensors file" in line

    def test_directory_named_safetensors(self, tmp_path, capsys):
        d = _model_dir(tmp_path, weights=False)
        (d / "model.safetensors").mkdir()
        line = _refused(_config(tmp_path, **_pretrained(d)), capsys)
        assert f"{d / 'model.safetensors'} is a directory, not a file" in line

    def test_index_names_a_missing_shard(self, tmp_path, capsys):
        d = _model_dir(tmp_path)
        index = {"weight_map": {"lm_head.weight": "model.safetensors", "x": "model-00002.safetensors"}}
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        line = _refused(_config(tmp_path, **_pretrained(d)), capsys)
        assert (
            f"{d / 'model-00002.safetensors'} (named by model.safetensors.index.json) does not exist" in line
        )

    def test_config_json_is_not_json(self, tmp_path, capsys):
        d = _model_dir(tmp_path)
        (d / "config.json").write_text("{model_type: llama")
        line = _refused(_config(tmp_path, **_pretrained(d)), capsys)
        assert f"{d / 'config.json'} is not JSON" in line

    def test_model_path_is_a_file(self, tmp_path, capsys):
        f = tmp_path / "model.safetensors"
        f.write_bytes(b"x")
        line = _refused(_config(tmp_path, **_pretrained(f)), capsys)
        assert f"model.pretrained_model_name_or_path='{f}': is a file" in line

    def test_unreadable_weights_for_a_user(self, open_dir, capsys):
        d = _model_dir(open_dir)
        (d / "model.safetensors").chmod(0)
        config = _config(open_dir, **_pretrained(d))
        run_cli(["validate", str(config)])  # imports every module the check needs, as root
        capsys.readouterr()
        with _as_nobody():
            line = _refused(config, capsys)
        assert f"{d / 'model.safetensors'} cannot be read (Permission denied)" in line

    def test_tokenizer_directory_without_tokenizer_files(self, tmp_path, capsys):
        (tmp_path / "tok").mkdir()
        (tmp_path / "tok" / "README.md").write_text("no tokenizer here")
        line = _refused(_config(tmp_path, tokenizer={"path": str(tmp_path / "tok")}), capsys)
        assert f"tokenizer.path='{tmp_path / 'tok'}': holds none of the tokenizer files" in line


@full_only  # ~8-25 s of imports on 2 busy cores; the CPU suite runs the same `run_cli` in-process
def test_pickled_weights_console_script(tmp_path):
    """The issue's case as the real command: one stderr line and exit 2, not a 30-line traceback."""
    d = _model_dir(tmp_path, weights=False)
    torch.save({"lm_head.weight": torch.zeros(4, 4)}, d / "pytorch_model.bin")
    config = _config(tmp_path, **_pretrained(d))
    proc = subprocess.run(
        [sys.executable, "-m", "automodel.recipes.cli", "train", str(config), "--nproc-per-node", "2"],
        capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "model.allow_pickle_weights" in lines[0] and "pytorch_model.bin" in lines[0]
    assert not (tmp_path / "run").exists()


# ---- the checkpoint to restore ----------------------------------------------------------------------
def _fake_checkpoint(d: Path, metadata: bytes, *, listed: int | None = None) -> Path:
    """A step directory complete by its sizes, whose only file is `metadata`."""
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(metadata)
    size = len(metadata) if listed is None else listed
    (d / "checkpoint.json").write_text(json.dumps({"step": 1, "files": {".metadata": size}}))
    return d


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


class TestCheckpoint:
    def test_garbage_metadata(self, tmp_path, capsys):
        bad = _fake_checkpoint(tmp_path / "bad", b"\x00garbage")
        before = _snapshot(bad)
        line = _refused(_config(tmp_path, checkpoint={"enabled": True, "restore_from": str(bad)}), capsys)
        assert f"checkpoint.restore_from='{bad}': checkpoint {bad} is corrupt: {bad / '.metadata'}" in line
        assert "is not DCP metadata" in line
        assert _snapshot(bad) == before

    def test_truncated_metadata(self, tmp_path, capsys):
        full = pickle.dumps(Metadata(state_dict_metadata={}))
        bad = _fake_checkpoint(tmp_path / "bad", full[:-5], listed=len(full))
        line = _refused(_config(tmp_path, checkpoint={"enabled": True, "restore_from": str(bad)}), capsys)
        assert f"checkpoint {bad} is corrupt: wrong size of .metadata" in line

    def test_restore_from_names_a_file(self, tmp_path, capsys):
        f = tmp_path / "step_3.tar"
        f.write_bytes(b"x")
        line = _refused(_config(tmp_path, checkpoint={"enabled": True, "restore_from": str(f)}), capsys)
        assert f"checkpoint {f} does not exist or is not a directory" in line

    def test_listed_file_is_a_fifo(self, tmp_path, capsys):
        bad = _fake_checkpoint(tmp_path / "bad", pickle.dumps(Metadata(state_dict_metadata={})))
        os.mkfifo(bad / "__0_0.distcp")  # a file the ranks would block on, never a checkpoint's
        info = json.loads((bad / "checkpoint.json").read_text())
        info["files"]["__0_0.distcp"] = 0
        (bad / "checkpoint.json").write_text(json.dumps(info))
        line = _refused(_config(tmp_path, checkpoint={"enabled": True, "restore_from": str(bad)}), capsys)
        assert f"{bad / '__0_0.distcp'} is not a regular file" in line

    def test_resume_target_is_corrupt(self, tmp_path, capsys):
        """No restore_from: the newest complete checkpoint of output_dir is the one checked."""
        ckpts = tmp_path / "run" / "checkpoints"
        _fake_checkpoint(ckpts / "step_1", b"\x00garbage")
        before = _snapshot(tmp_path / "run")
        assert run_cli(["train", str(_config(tmp_path, checkpoint={"enabled": True}))]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"error: output_dir='{ckpts}': the run would resume from its newest checkpoint" in err[0]
        assert f"{ckpts / 'step_1' / '.metadata'} is not DCP metadata" in err[0]
        assert _snapshot(tmp_path / "run") == before  # no lock file, no log, checkpoint untouched

    def test_checkpoint_dir_is_a_file(self, tmp_path, capsys):
        f = tmp_path / "ckpts"
        f.write_text("not a folder")
        line = _refused(_config(tmp_path, checkpoint={"enabled": True, "checkpoint_dir": str(f)}), capsys)
        assert f"checkpoint.checkpoint_dir='{f}': is a file where the run keeps its checkpoints" in line


# ---- data files -------------------------------------------------------------------------------------
def _json_data(path: str) -> dict[str, Any]:
    return {"dataset": {"source": "json", "path": path, "seq_length": 32}}


class TestDataFiles:
    def test_parquet_column_of_the_wrong_type(self, tmp_path, capsys):
        """``bad_rows: error`` too: read by `datasets`, the int column made 0 rows, naming no file."""
        f = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": [1, 2, 3]}), f)
        cfg = _config(tmp_path, dataset={"source": "parquet", "path": str(f), "seq_length": 32})
        line = _refused(cfg, capsys)
        assert f"dataset.path='{f}': column 'text' holds int64, not text" in line

    def test_truncated_parquet(self, tmp_path, capsys):
        f = tmp_path / "d.parquet"
        pq.write_table(pa.table({"text": ["a b c"] * 50}), f)
        f.write_bytes(f.read_bytes()[:-20])
        cfg = _config(tmp_path, dataset={"source": "parquet", "path": str(f), "seq_length": 32})
        assert f"dataset.path='{f}': cannot be read as Parquet" in _refused(cfg, capsys)

    def test_json_lines_named_parquet(self, tmp_path, capsys):
        f = tmp_path / "d.parquet"
        f.write_text('{"text": "a"}\n')
        cfg = _config(tmp_path, dataset={"source": "parquet", "path": str(f), "seq_length": 32})
        assert f"dataset.path='{f}': cannot be read as Parquet" in _refused(cfg, capsys)

    def test_directory_where_a_file_is_expected(self, tmp_path, capsys):
        (tmp_path / "d.jsonl").mkdir()
        line = _refused(_config(tmp_path, **_json_data(str(tmp_path / "d.jsonl"))), capsys)
        assert f"dataset.path='{tmp_path / 'd.jsonl'}': is a directory, not a file" in line

    def test_fifo_is_refused_not_waited_on(self, tmp_path, capsys):
        os.mkfifo(tmp_path / "d.jsonl")
        line = _refused(_config(tmp_path, **_json_data(str(tmp_path / "d.jsonl"))), capsys)
        assert "is not a regular file (a FIFO, socket or device)" in line

    def test_dangling_symlink(self, tmp_path, capsys):
        (tmp_path / "d.jsonl").symlink_to(tmp_path / "gone.jsonl")
        line = _refused(_config(tmp_path, **_json_data(str(tmp_path / "d.jsonl"))), capsys)
        assert f"dataset.path='{tmp_path / 'd.jsonl'}': does not exist" in line

    def test_unreadable_for_a_user(self, open_dir, capsys):
        """Mode 000 as a user (root reads it: `_as_nobody`): was a 36-line traceback and exit 1."""
        f = open_dir / "d.jsonl"
        f.write_text('{"text": "hello world"}\n' * 20)
        f.chmod(0)
        config = _config(open_dir, **_json_data(str(f)))
        run_cli(["validate", str(config)])  # imports every module the check needs, as root
        capsys.readouterr()
        with _as_nobody():
            line = _refused(config, capsys)
        assert line == f"error: dataset.path='{f}': cannot be read (Permission denied)"


# ---- inside the ranks -------------------------------------------------------------------------------
def _bin_not_a_state_dict(tmp: Path) -> Path:
    """Opted-in pickled weights holding a list: the ranks refuse it (a project ValueError, found
    only when torch.load reads the file, which the launcher does not do)."""
    d = _model_dir(tmp, weights=False)
    torch.save([torch.zeros(1)], d / "pytorch_model.bin")
    return _config(tmp, **_pretrained(d, allow_pickle_weights=True))


def test_project_value_error_in_the_run_is_one_line(tmp_path, capsys, monkeypatch):
    """`_run_guarded`, the guard `recipes train` runs a single-process run in, around the real load
    that refuses the file: one line and exit 2, the traceback in a file."""
    from automodel.recipes.checkpoint.pretrained import load_pretrained_weights
    from automodel.recipes.model import build_meta_model

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a run without output_dir logs
    config = yaml.safe_load(_bin_not_a_state_dict(tmp_path).read_text())
    model = build_meta_model(AutoConfig.for_model("llama", **TINY_SIZES)).to_empty(device="cpu")

    def load() -> Any:
        load_pretrained_weights(
            [model], config["model"]["pretrained_model_name_or_path"], allow_pickle_weights=True
        )

    assert _run_guarded(load, rank=0, error_dir=None) == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("error: model directory") and "is not a state dict" in err[0]
    assert err[1] == f"  (full traceback: {tmp_path / 'rank_0.error.log'})"
    assert "Traceback" in (tmp_path / "rank_0.error.log").read_text()


@full_only  # ~30 s on 2 busy cores
def test_project_value_error_in_the_run_is_one_line_single_process(tmp_path):
    config = _bin_not_a_state_dict(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "automodel.recipes.cli", "train", str(config)],
        capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pytorch_model.bin is not a state dict of tensors" in errors[0]
    assert "Traceback" not in proc.stderr
    assert "Traceback" in (tmp_path / "run" / "logs" / "rank_0.error.log").read_text()


@full_only
def test_project_value_error_in_the_ranks_is_one_line_two_ranks(tmp_path):
    config = _bin_not_a_state_dict(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "automodel.recipes.cli", "train", str(config), "--nproc-per-node", "2"],
        capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "pytorch_model.bin is not a state dict of tensors" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr


def _torch_value_error() -> None:
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=-1.0)  # torch raises ValueError


def test_torch_value_error_in_the_run_keeps_its_traceback(tmp_path, monkeypatch):
    """`_run_guarded`, the rank's guard under the CLI: torch's ValueError is re-raised (Python
    prints its traceback, exit 1), never turned into a user's one line."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a run without output_dir logs
    with pytest.raises(ValueError, match="Invalid learning rate") as err:
        _run_guarded(_torch_value_error, rank=0, error_dir=None)
    assert classify(err.value) == (EXIT_RUN_ERROR, "")
    report_dir = tmp_path / "reports"
    report_dir.mkdir()
    assert _run_guarded(_torch_value_error, rank=0, error_dir=str(report_dir)) == EXIT_RUN_ERROR
    report = json.loads((report_dir / "rank_0.json").read_text())
    assert report["line"] == "" and report["exit_code"] == EXIT_RUN_ERROR  # the launcher prints the traceback


# A module of the project's namespace, so its frames are automodel's (as the sibling packages' are).
_PROBE = types.ModuleType("automodel._refusal_probe")
exec(  # noqa: S102 - the probe's source is this literal
    """
def deliberate():
    raise ValueError(
        "pp_size=3 does not divide 8 layers"
    )

def wrapped():
    try:
        int("x")
    except ValueError as e:
        raise ValueError(f"bad size: {e}") from e

def builtin_in_our_code():
    return int("not a number")

def unpacking_in_our_code():
    a, b = [1, 2, 3]

def library_error_reraised_by_name(call):
    try:
        call()
    except ValueError as e:
        err = e
    raise err

def library_error_reraised_bare(call):
    try:
        call()
    except ValueError:
        raise
""",
    _PROBE.__dict__,
)


@pytest.mark.parametrize(
    ("call", "user"),
    [
        (lambda: _PROBE.deliberate(), True),
        (lambda: _PROBE.wrapped(), True),
        (lambda: _PROBE.builtin_in_our_code(), False),
        (lambda: _PROBE.unpacking_in_our_code(), False),
        (_torch_value_error, False),
        (lambda: _PROBE.library_error_reraised_by_name(_torch_value_error), False),
        (lambda: _PROBE.library_error_reraised_bare(_torch_value_error), False),
        (lambda: int("x"), False),  # a test module is not automodel's
    ],
    ids=["raise", "raise_from", "int", "unpack", "torch", "reraise_named", "reraise_bare", "outside"],
)
def test_which_value_errors_are_the_users(call, user):
    with pytest.raises(ValueError) as err:
        call()
    assert is_user_error(err.value) is user
    code, line = classify(err.value)
    assert (code, bool(line)) == ((EXIT_USER_ERROR, True) if user else (EXIT_RUN_ERROR, False))


def test_sibling_package_value_error_is_the_users():
    """A sibling package cannot import `ConfigError`: automodel.mesh refuses a size with a plain
    ValueError, which is the user's all the same."""
    from automodel.mesh.sizes import ParallelismSizes

    with pytest.raises(ValueError, match="tp_size must be >= 1") as err:
        ParallelismSizes(tp_size=0)
    assert is_user_error(err.value)
    assert classify(err.value) == (EXIT_USER_ERROR, "tp_size must be >= 1, got 0")
