"""benchmarks/automodel_peer_cpu.py offline (the real run is `nox -s automodel_peer`: it needs the
registry): the patch file is well-formed with a note on every hunk, arguments are checked, both
trainers get the same overrides, the recipe files are read from a work tree or a git dir, the
tokenizers label as the benchmark says, and the report's figures are computed from the steps."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("automodel_peer_cpu")


def _hunks(text: str) -> list[tuple[str, list[str]]]:
    """(file, body lines) per hunk, checking each hunk's line counts against its header."""
    out: list[tuple[str, list[str]]] = []
    lines = text.splitlines()
    current = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("+++ b/"):
            current = line[len("+++ b/") :]
        m = re.match(r"@@ -\d+,(\d+) \+\d+,(\d+) @@", line)
        if m:
            old, new = int(m[1]), int(m[2])
            body = []
            i += 1
            while old > 0 or new > 0:
                b = lines[i]
                body.append(b)
                old -= b[:1] in (" ", "-")
                new -= b[:1] in (" ", "+")
                i += 1
            assert old == 0 and new == 0, f"hunk counts of {current} do not match its header"
            out.append((current, body))
            continue
        i += 1
    return out


def test_patch_file_is_well_formed_and_every_hunk_has_a_note(bench) -> None:
    text = bench.PATCH.read_text()
    hunks = _hunks(text)
    files = {f for f, _ in hunks}
    assert files == {
        "nemo_automodel/_transformers/auto_model.py",
        "nemo_automodel/components/_peft/lora.py",
        "nemo_automodel/components/_peft/lora_kernel.py",
        "nemo_automodel/components/distributed/fsdp_patches.py",
        "nemo_automodel/recipes/llm/train_ft.py",
    }
    preamble = text[: text.index("--- a/")]
    for path, body in hunks:
        notes = [b for b in body if b.startswith("+") and re.search(r"# peer patch: \S.{10,}", b)]
        assert notes, f"a hunk of {path} carries no '# peer patch:' note"
        assert Path(path).name in preamble, f"{path} is not described above the diff"
    # every changed line stays a device choice: nothing removed without a replacement
    assert all(any(b.startswith("+") for b in body) for _, body in hunks)


def test_arguments_are_checked(bench, tmp_path: Path) -> None:
    args = bench.parse_args(["--automodel-checkout", str(tmp_path)])
    assert args.files == ["squad", "squad_lora", "hellaswag", "chat"]
    assert args.modes == ["as_written", "equal"] and args.nproc == 2 and args.steps == 10
    assert not args.venv.resolve().is_relative_to(bench.ROOT)
    with pytest.raises(SystemExit, match=r"--files=squad,nope: unknown nope"):
        bench.parse_args(["--automodel-checkout", str(tmp_path), "--files", "squad,nope"])
    with pytest.raises(SystemExit, match=r"--modes=: unknown empty"):
        bench.parse_args(["--automodel-checkout", str(tmp_path), "--modes", ""])
    for bad in (["--nproc", "0"], ["--venv", str(bench.ROOT / ".peer")]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--automodel-checkout", str(tmp_path), *bad])


def test_both_trainers_get_the_same_overrides(bench, tmp_path: Path) -> None:
    art = {k: tmp_path / k for k in ("model_bos", "model_eos", "squad", "hellaswag", "chat")}
    for name, recipe in bench.FILES.items():
        for mode in bench.MODES:
            ov = bench.common_overrides(recipe, mode, art, 7)
            am = bench.automodel_command(tmp_path / "py", tmp_path / "f.yaml", 2, ov, tmp_path / "am")
            ours = bench.ours_command(tmp_path / "f.yaml", 2, ov, tmp_path / "ours")
            # the same overrides, in the same order; only the log location differs
            assert am[am.index(ov[0]) : am.index(ov[0]) + len(ov)] == ov, name
            assert ours[ours.index(ov[0]) : ours.index(ov[0]) + len(ov)] == ov, name
            assert am[-1].startswith("--checkpoint.checkpoint_dir=") and ours[-1].startswith("--output_dir=")
            model = "model_bos" if mode == "as_written" else "model_eos"
            assert f"--model.pretrained_model_name_or_path={art[model]}" in ov
            assert "--seed=1111" in ov and "--rng.seed=1111" in ov and "--step_scheduler.max_steps=7" in ov
            assert set(bench.FP32) <= set(ov) if mode == "equal" else not set(bench.FP32) & set(ov)
            data = [o for o in ov if o.startswith(("--dataset.", "--validation_dataset."))]
            assert len(data) == 2 and all(str(art[recipe.data]) in o for o in data)


def test_lora_equal_mode_starts_ours_from_automodels_initial_adapter(bench, tmp_path: Path) -> None:
    """Only a LoRA file's equal mode: AutoModel's own python runs the dump script with exactly its
    training run's overrides, and ours gets the adapter directory through its own key."""
    art = {k: tmp_path / k for k in ("model_bos", "model_eos", "squad", "hellaswag", "chat")}
    adapter = tmp_path / "adapter"
    for name, recipe in bench.FILES.items():
        for mode in bench.MODES:
            extra = bench.initial_adapter_overrides(recipe, mode, adapter)
            want = name == "squad_lora" and mode == "equal"
            assert extra == ([f"--peft.initial_adapter={adapter}"] if want else []), (name, mode)
    lora = bench.FILES["squad_lora"]
    ov = [*bench.common_overrides(lora, "equal", art, 7), f"--checkpoint.checkpoint_dir={tmp_path / 'am'}"]
    cmd = bench.initial_adapter_command(tmp_path / "py", tmp_path / "f.yaml", 2, ov, adapter)
    train = bench.automodel_command(tmp_path / "py", tmp_path / "f.yaml", 2, ov[:-1], tmp_path / "am")
    torchrun = train[: train.index("nemo_automodel.cli.app") - 1]  # AutoModel's python, torchrun, N processes
    assert cmd[: cmd.index(str(bench.INITIAL_ADAPTER))] == torchrun
    assert cmd[cmd.index(str(bench.INITIAL_ADAPTER)) + 1 :] == [str(adapter), str(tmp_path / "f.yaml"), *ov]
    assert ov == train[train.index(str(tmp_path / "f.yaml")) + 1 :]  # the training run's overrides, in order
    assert bench.INITIAL_ADAPTER.is_file()


def test_recipe_read_from_work_tree_or_git_dir(bench, tmp_path: Path) -> None:
    repo = tmp_path / "Automodel"
    rel = "llama3_2/x.yaml"
    (repo / "examples" / "llm_finetune" / "llama3_2").mkdir(parents=True)
    (repo / "examples" / "llm_finetune" / rel).write_text("recipe: A\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.check_output([*git, "rev-parse", "HEAD"], text=True).strip()
    assert bench.read_recipe(repo, rel, tmp_path / "a.yaml").read_text() == "recipe: A\n"
    assert bench.read_recipe(repo / ".git", rel, tmp_path / "b.yaml").read_text() == "recipe: A\n"
    assert bench.checkout_commit(repo) == bench.checkout_commit(repo / ".git") == head
    # a file's own process count caps --nproc
    (tmp_path / "one.yaml").write_text("ci:\n  nproc_per_node: 1\n")
    (tmp_path / "any.yaml").write_text("recipe: A\n")
    assert bench.processes(tmp_path / "one.yaml", 2) == 1 and bench.processes(tmp_path / "any.yaml", 2) == 2


def test_tokenizers_label_as_documented(tmp_path: Path) -> None:
    art = _load("_automodel_peer_artefacts")
    from transformers import AutoTokenizer

    for bos in (True, False):
        art.save_tokenizer(tmp_path / str(bos), bos=bos)
        tok = AutoTokenizer.from_pretrained(str(tmp_path / str(bos)))
        ids = tok("ab")["input_ids"]
        assert ids == ([1] if bos else []) + [art.vocabulary()["a"], art.vocabulary()["b"]] + (
            [] if bos else [2]
        )
        assert tok.chat_template is None  # SQuAD / HellaSwag as plain prompt + answer on both sides
    rng = __import__("random").Random(0)
    rows = art.squad_rows(rng, 20)
    assert all(r["answers"]["text"][0] in r["context"] for r in rows)
    assert rows == art.squad_rows(__import__("random").Random(0), 20)


def test_report_figures(bench) -> None:
    Step, Run = bench.Step, bench.Run
    am = Run("automodel", [Step(4.0, 2.0, 10, 9.0), Step(3.9, 1.9, 11, 1.0), Step(3.8, 1.8, 12, 3.0)])
    ours = Run(
        "ours", [Step(4.0, 2.0, 10, 5.0), Step(3.9000004, 1.9, 11, 0.5), Step(3.8, 1.8000002, 12, 1.0)]
    )
    row = bench.summary_row("squad", "equal", 2, am, ours)
    assert row["steps"] == 3 and row["labels_equal"] is True
    assert row["max_loss_diff"] == pytest.approx(4e-7, rel=1e-3)
    assert row["max_grad_norm_diff"] == pytest.approx(2e-7, rel=1e-3)
    # medians after the first step: AutoModel 2.0 s, ours 0.75 s
    assert row["automodel_s"] == 2.0 and row["ours_s"] == 0.75 and row["ratio"] == 0.375
    text = bench.report([("squad", "equal", 2, am, ours)], header="H")
    assert (
        "| squad | equal labels, fp32 both | 2 | 3 | 4.0e-07 | 2.0e-07 | yes | 2.00 | 0.75 | 0.38 |" in text
    )
    assert "| 2 | 3.9000000 | 3.9000004 | 4.0e-07 | 1.900000 / 1.900000 | 11 / 11 | 1.00 / 0.50 |" in text
    failed = bench.summary_row("chat", "as_written", 1, Run("automodel", error="exit 1, see x"), ours)
    assert "failed: exit 1, see x" in bench.summary_table([failed])
