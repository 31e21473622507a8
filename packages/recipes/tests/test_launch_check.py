"""One resolution per launch (`resolved_run.resolve_run`, running `launch_check.check_launch`):
`recipes validate`, `recipes train`, the Python API and `recipes plan` refuse the same bad config
with the same message and resolve the same config alike; the meta model is built once per process."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from automodel.recipes import load_config
from automodel.recipes.api import train
from automodel.recipes.cli import run_cli
from automodel.recipes.errors import ConfigError

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402

# GPT-2 declares no tensor-parallel plan: tp_size=2 is refused by the model-dependent rules
GPT2 = {
    "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 64,
    "bos_token_id": 0, "eos_token_id": 0,
}  # fmt: skip


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _cli_error(args: list[str], capsys: pytest.CaptureFixture) -> str:
    assert run_cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0].removeprefix("error: ")


def _api_error(raw: dict, *, world_size: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """`automodel.recipes.train` as a rank of a `world_size` job (torchrun's variables): refused
    before its process group exists."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(ConfigError) as err:
        train(load_config(raw))
    return str(err.value)


@pytest.mark.parametrize(
    ("sections", "world", "expected"),
    [
        (
            {"optimizer": {"weight_decayy": 0.1}},
            1,
            "optimizer.weight_decayy=0.1: is not an argument of AdamW",
        ),
        (
            {"model": {"config": GPT2}, "distributed": {"tp_size": 2}},
            2,
            "distributed.tp_size=2: cannot be applied: ",
        ),
        (  # the optimizer is also built on the meta model's parameters: Muon takes only matrices
            {"optimizer": {"_target_": "torch.optim.Muon", "lr": 0.02}},
            1,
            "optimizer._target_='torch.optim.Muon': cannot be built on this model's",
        ),
    ],
    ids=["optimizer_key", "model_rule", "optimizer_on_model"],
)
def test_every_path_refuses_with_the_same_message(
    sections: dict,
    world: int,
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "out"
    raw = tiny_config(str(out), **sections)
    path = _write(tmp_path, raw)
    validate = _cli_error(["validate", str(path), f"--world-size={world}"], capsys)
    launcher = _cli_error(["train", str(path), f"--nproc-per-node={world}"], capsys)
    api = _api_error(raw, world_size=world, monkeypatch=monkeypatch)
    assert expected in validate
    assert validate == launcher == api
    assert not out.exists()  # refused before anything is written


def test_plan_proposes_only_what_train_accepts_and_shows_the_same_refusal(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`recipes plan` checks each layout it would propose with the same entry: GPT-2's tp=2 layout
    fits in memory but is refused, with `recipes validate`'s message; the YAML it prints validates."""
    model = tmp_path / "gpt2.json"
    model.write_text(json.dumps(GPT2))
    assert run_cli(["plan", "--model", str(model), "--gpus", "2", "--seq-len", "64"]) == 0
    printed = capsys.readouterr().out
    rows = [line.split() for line in printed.splitlines() if line[:2].strip().isdigit()]
    assert rows and all(row[1] == "1" for row in rows), printed  # no tp=2 row
    refusals = printed.split("refused by the checks recipes train runs before launch")[1]
    refusals = refusals.split("# paste into the recipe YAML:")[0]

    raw = tiny_config(str(tmp_path / "out"), model={"config": GPT2}, distributed={"tp_size": 2})
    raw["dataset"] = {**raw["dataset"], "seq_length": 64}
    validate = _cli_error(["validate", str(_write(tmp_path, raw)), "--world-size=2"], capsys)
    assert f"layout: {validate}" in refusals or f"layouts: {validate}" in refusals, (validate, refusals)

    block = yaml.safe_load(printed.split("# paste into the recipe YAML:")[1])
    proposed = tiny_config(str(tmp_path / "out"), model={"config": GPT2}, **block)
    proposed["dataset"] = {**proposed["dataset"], "seq_length": 64}
    assert run_cli(["validate", str(_write(tmp_path, proposed)), "--world-size=2"]) == 0, (
        capsys.readouterr().err
    )


def test_the_run_files_are_read_once_per_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`recipes train` reads the data rows, weights and restore checkpoint before launch; the rank it
    starts does not read them again (a rank reached through the Python API alone does)."""
    import automodel.recipes.launch_check as launch_check

    reads: list[str] = []
    monkeypatch.setattr(launch_check, "check_run_files", lambda cfg: reads.append(cfg.output_dir))
    raw = tiny_config(str(tmp_path / "cli"), step_scheduler={"max_steps": 1, "val_every_steps": None})
    raw["validation_dataset"] = None
    assert run_cli(["train", str(_write(tmp_path, raw))]) == 0
    assert reads == [str(tmp_path / "cli")]
    raw["output_dir"] = str(tmp_path / "api")
    train(load_config(raw))
    assert reads[1:] == [str(tmp_path / "api")]


# ---- one resolved run per launch ----------------------------------------------------------------

#: Injected into the ranks `recipes train` starts (PYTHONPATH): counts every meta-model build
#: (`AutoModelForCausalLM.from_config`, the one builder) per process, into COUNT_FILE.
_COUNTING_SITECUSTOMIZE = """
import os
if "RANK" in os.environ:  # the ranks torchrun starts, not its agent
    import transformers

    _build = transformers.AutoModelForCausalLM.from_config.__func__

    def _counted(cls, *args, **kwargs):
        with open({count_file!r}, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
        return _build(cls, *args, **kwargs)

    transformers.AutoModelForCausalLM.from_config = classmethod(_counted)
"""


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Meta-model and HF-config builds in this process, by kind."""
    import transformers

    import automodel.recipes.launch_check as launch_check
    import automodel.recipes.resolved_run as resolved_run

    counts = {"model": 0, "hf_config": 0}
    build = transformers.AutoModelForCausalLM.from_config.__func__

    def counted_model(cls, *args, **kwargs):
        counts["model"] += 1
        return build(cls, *args, **kwargs)

    def counted_config(real):
        def wrapper(*args, **kwargs):
            counts["hf_config"] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", classmethod(counted_model))
    for module in (resolved_run, launch_check):
        monkeypatch.setattr(module, "build_hf_config", counted_config(module.build_hf_config))
    return counts


def test_the_meta_model_is_built_once_per_process_single(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A one-process `recipes train`: the launch checks' meta model is the one the trainer
    parallelizes (at 172098f: 3 meta models and 3 HF configs in this process)."""
    counts = _count_builds(monkeypatch)
    raw = tiny_config(str(tmp_path / "out"), step_scheduler={"max_steps": 1, "val_every_steps": None})
    raw["validation_dataset"] = None
    assert run_cli(["train", str(_write(tmp_path, raw))]) == 0
    assert counts == {"model": 1, "hf_config": 1}


def test_the_meta_model_is_built_once_per_process_two_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`recipes train --nproc-per-node=2`: the launcher resolves once (one model, one HF config);
    each rank trains the pickled `ResolvedRun` and builds its meta model once, checking nothing but
    its process group (at 172098f: 1 in the launcher, 2 in each rank)."""
    counts = _count_builds(monkeypatch)
    count_file = tmp_path / "rank_builds.txt"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_COUNTING_SITECUSTOMIZE.format(count_file=str(count_file)))
    monkeypatch.setenv("PYTHONPATH", f"{site}:{__import__('os').environ.get('PYTHONPATH', '')}")
    import automodel.recipes.launch_check as launch_check

    checks: list[int] = []
    real_check = launch_check.check_layout_rules
    monkeypatch.setattr(
        launch_check, "check_layout_rules", lambda *a, **k: checks.append(1) or real_check(*a, **k)
    )
    raw = tiny_config(str(tmp_path / "out"), step_scheduler={"max_steps": 1, "val_every_steps": None})
    raw["validation_dataset"] = None
    assert run_cli(["train", str(_write(tmp_path, raw)), "--nproc-per-node=2"]) == 0
    assert counts == {"model": 1, "hf_config": 1} and checks == [1]  # the launcher: once
    pids = count_file.read_text().split()
    assert len(pids) == 2 and len(set(pids)) == 2, pids  # each rank: once


def test_every_path_goes_through_the_one_resolution(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`recipes validate`, `recipes plan`, `recipes train` and `automodel.recipes.train` each build
    their `ResolvedRun` in `resolve_run`; validate's (machine-neutral) and train's agree on the
    layout, the HF config and the stages, and train's equals the API's."""
    import automodel.recipes.resolved_run as resolved_run

    made: list[resolved_run.ResolvedRun] = []

    class Recorded(resolved_run.ResolvedRun):
        def __init__(self, **fields: Any) -> None:
            super().__init__(**fields)
            made.append(self)

    monkeypatch.setattr(resolved_run, "ResolvedRun", Recorded)
    raw = tiny_config(str(tmp_path / "out"), step_scheduler={"max_steps": 1, "val_every_steps": None})
    raw["validation_dataset"] = None
    path = _write(tmp_path, raw)
    assert run_cli(["validate", str(path), "--world-size=1"]) == 0
    assert run_cli(["train", str(path)]) == 0
    raw["output_dir"] = str(tmp_path / "api")
    train(load_config(raw))
    validate, cli_train, api = made
    assert not validate.for_this_machine and cli_train.for_this_machine and api.for_this_machine
    for run in (cli_train, api):
        assert (run.layout, run.hf_config.to_dict(), run.stages, run.world_size) == (
            validate.layout, validate.hf_config.to_dict(), validate.stages, validate.world_size,
        )  # fmt: skip
    assert cli_train.cfg.distributed == api.cfg.distributed and cli_train.files_read and api.files_read
    model = tmp_path / "gpt2.json"
    model.write_text(json.dumps(GPT2))
    assert run_cli(["plan", "--model", str(model), "--gpus", "2", "--seq-len", "64"]) == 0
    assert len(made) > 3 and not any(r.for_this_machine for r in made[3:])  # each layout it proposes
    capsys.readouterr()


def test_a_rank_handed_a_run_checks_only_its_process_group(tmp_path: Path) -> None:
    """A pickled `ResolvedRun` loads equal (the meta model stays in the resolving process); a rank
    refuses one resolved for another world size or for planning."""
    from automodel.recipes.resolved_run import ResolvedRun, check_rank, resolve_run

    cfg = load_config(tiny_config(str(tmp_path / "out")))
    run = resolve_run(cfg, world_size=2, this_machine=True)
    run.save(tmp_path / "run.pkl")
    loaded = ResolvedRun.load(tmp_path / "run.pkl")
    # the loss callable is an instance (equal by identity): the copy is of the same class and keys
    assert repr(loaded.cfg.loss_fn) == repr(run.cfg.loss_fn)
    same_loss = dataclasses.replace(loaded, cfg=dataclasses.replace(loaded.cfg, loss_fn=run.cfg.loss_fn))
    assert same_loss == run and run.meta_model is not None and loaded.take_meta_model() is None
    check_rank(loaded, world_size=2)
    with pytest.raises(ConfigError, match="resolved for 2"):
        check_rank(loaded, world_size=4)
    with pytest.raises(ConfigError, match="planning"):
        check_rank(resolve_run(cfg, world_size=2, this_machine=False), world_size=2)
