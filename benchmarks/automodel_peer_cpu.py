"""NeMo AutoModel 0.7.0 itself against `recipes train` on the same AutoModel recipe files (CPU, gloo).

Installs ``nemo-automodel==0.7.0`` from the registry into a venv outside the repository (default
``~/.cache/automodel-peer/nemo-automodel-0.7.0``, reused while its marker names the same patch),
applies ``benchmarks/automodel_0.7.0_cpu.patch`` (device choices only; a note on each hunk) to the
installed copy, writes one tiny random Llama, two character-level tokenizers and 640 SQuAD-,
HellaSwag- and chat-format rows (`_automodel_peer_artefacts`), then trains each recipe file with

    torchrun --standalone --nproc-per-node N -m nemo_automodel.cli.app FILE --key=value ...   (AutoModel)
    uv run --frozen recipes train FILE --nproc-per-node N --key=value ...                    (ours)

one after the other, with the same overrides: the model directory, the dataset paths, gloo,
``step_scheduler.max_steps``, ``seed`` and ``rng.seed`` (AutoModel 0.7 seeds with the top-level
``seed`` and ignores ``rng.seed``), ``checkpoint.enabled=false``; only where each writes its logs
differs (``checkpoint.checkpoint_dir`` / ``output_dir``). Two comparisons per file:

- ``as_written``: the tokenizer prepends BOS (Llama 3.2's); mixed precision as each defaults
  (AutoModel: FSDP2 bf16 compute even on CPU; ours: fp32).
- ``equal``: the tokenizer appends EOS and no BOS, so AutoModel's prompt length is right and both
  label the answer and EOS; ``distributed.mp_policy`` fp32 (param, reduce and output dtype) for both.
  LoRA files: both start from AutoModel's initial adapter. AutoModel draws each rank's shard of
  ``lora_A`` from that rank's own stream (seed + rank) after the base weights' random init, which
  no layout-independent rule reproduces, so `_automodel_initial_adapter.py` (AutoModel's python,
  torchrun, the same file and overrides) runs AutoModel's own ``setup()`` and writes the adapters
  it starts from in PEFT format, and ours gets ``--peft.initial_adapter=DIR`` (a key of ours only:
  AutoModel's PeftConfig has none; AutoModel's run is unchanged).

Prints per-step losses, grad norms, label tokens and step times side by side, and per file the
largest loss difference and the ratio of median step times (steps after the first), as markdown.
The YAMLs are read from an NVIDIA-NeMo/Automodel checkout (a work tree or a bare git directory),
never vendored:

    uv run --frozen nox -s automodel_peer -- --automodel-checkout PATH [--nproc 2] [--steps 10]
    uv run --frozen python benchmarks/automodel_peer_cpu.py --automodel-checkout PATH [...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PATCH = ROOT / "benchmarks" / "automodel_0.7.0_cpu.patch"
INITIAL_ADAPTER = ROOT / "benchmarks" / "_automodel_initial_adapter.py"
AUTOMODEL = "nemo-automodel==0.7.0"
DEFAULT_VENV = Path.home() / ".cache" / "automodel-peer" / "nemo-automodel-0.7.0"
SEED = 1111  # the files' own rng.seed
MODES = ("as_written", "equal")
#: fp32 compute for AutoModel's FSDP2 (its default is bf16 params even on CPU); ours accepts the same keys.
FP32 = (
    "--distributed.mp_policy._target_=torch.distributed.fsdp.MixedPrecisionPolicy",
    "--distributed.mp_policy.param_dtype=torch.float32",
    "--distributed.mp_policy.reduce_dtype=torch.float32",
    "--distributed.mp_policy.output_dtype=torch.float32",
)


@dataclass(frozen=True)
class RecipeFile:
    """One AutoModel file: its path in the checkout and the dataset keys that point at local rows."""

    name: str
    path: str
    data: str  # artefact name: squad, hellaswag, chat
    keys: tuple[str, str]  # dataset / validation_dataset path keys
    lora: bool = False  # a peft section: in the equal mode both start from AutoModel's initial adapter

    def data_overrides(self, artefacts: dict[str, Path]) -> list[str]:
        root = artefacts[self.data]
        train, val = (
            (root, root) if self.data != "chat" else (root / "train.jsonl", root / "validation.jsonl")
        )
        return [f"--dataset.{self.keys[0]}={train}", f"--validation_dataset.{self.keys[1]}={val}"]


FILES = {
    f.name: f
    for f in (
        RecipeFile("squad", "llama3_2/llama3_2_1b_squad.yaml", "squad", ("dataset_name", "dataset_name")),
        RecipeFile("squad_lora", "llama3_2/llama3_2_1b_squad_peft.yaml", "squad", ("dataset_name", "dataset_name"), lora=True),
        RecipeFile("hellaswag", "llama3_2/llama3_2_1b_hellaswag.yaml", "hellaswag", ("path_or_dataset", "path_or_dataset")),
        RecipeFile(
            "chat",
            "llama3_2/customizer_llama_3_2_1b_full_sft_chat.yaml",
            "chat",
            ("path_or_dataset_id", "path_or_dataset_id"),
        ),
    )
}  # fmt: skip


@dataclass
class Step:
    loss: float
    grad_norm: float
    label_tokens: int
    time_s: float


@dataclass
class Run:
    trainer: str  # "automodel" or "ours"
    steps: list[Step] = field(default_factory=list)
    error: str | None = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--automodel-checkout", type=Path, required=True, help="NVIDIA-NeMo/Automodel work tree or git dir"
    )
    p.add_argument("--files", default=",".join(FILES), help=f"comma-separated, of {', '.join(FILES)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (gloo ranks)")
    p.add_argument("--steps", type=int, default=10, help="step_scheduler.max_steps")
    p.add_argument("--rows", type=int, default=640, help="training rows per dataset (64 validation rows)")
    p.add_argument(
        "--venv", type=Path, default=DEFAULT_VENV, help="AutoModel's venv (outside the repository)"
    )
    p.add_argument("--work", type=Path, default=None, help="artefacts and logs (default: a temp dir)")
    p.add_argument("--report", type=Path, default=None, help="also write the markdown report here")
    args = p.parse_args(argv)
    args.files = _choices("--files", args.files, FILES)
    args.modes = _choices("--modes", args.modes, MODES)
    for name in ("nproc", "steps", "rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: must be >= 1")
    if args.venv.resolve().is_relative_to(ROOT):
        p.error(f"--venv={args.venv}: must be outside the repository ({ROOT})")
    return args


def _choices(flag: str, value: str, allowed: Iterable[str]) -> list[str]:
    known = list(allowed)
    names = [v for v in value.split(",") if v]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise SystemExit(
            f"{flag}={value}: unknown {', '.join(bad) or 'empty'}; choose from {', '.join(known)}"
        )
    return names


# --- AutoModel's venv -------------------------------------------------------------------------


def patch_digest() -> str:
    return hashlib.sha256(PATCH.read_bytes()).hexdigest()[:16]


def ensure_venv(venv: Path) -> Path:
    """The venv's python, with AutoModel installed and patched; reused while the marker matches."""
    python = venv / "bin" / "python"
    marker = venv / ".automodel-peer"
    want = f"{AUTOMODEL} {patch_digest()}"
    if marker.exists() and marker.read_text().strip() == want and python.exists():
        return python
    uv = shutil.which("uv") or sys.exit("uv not found on PATH (it installs AutoModel's venv)")
    if not python.exists():
        _run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)])
    _run([uv, "pip", "install", "--quiet", "--python", str(python), AUTOMODEL])
    # a pristine copy before patching (a previous patch may be applied)
    _run([uv, "pip", "install", "--quiet", "--python", str(python), "--reinstall-package", "nemo-automodel", "--no-deps", AUTOMODEL])  # fmt: skip
    site = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    _run(["patch", "-p1", "--forward", "--batch", "-d", site, "-i", str(PATCH)])
    marker.write_text(want + "\n")
    return python


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


# --- recipe files -----------------------------------------------------------------------------


def checkout_commit(checkout: Path) -> str:
    return subprocess.check_output(
        ["git", f"--git-dir={_git_dir(checkout)}", "rev-parse", "HEAD"], text=True
    ).strip()


def _git_dir(checkout: Path) -> Path:
    return checkout / ".git" if (checkout / ".git").exists() else checkout


def processes(file: Path, nproc: int) -> int:
    """`nproc`, or fewer where the file names its own count (``ci.nproc_per_node``; the chat file
    is a one-process file: ``dp_size: 1``, which ours refuses on 2 processes and AutoModel ignores)."""
    import yaml

    own = (yaml.safe_load(file.read_text()).get("ci") or {}).get("nproc_per_node")
    return min(nproc, own) if isinstance(own, int) and own > 0 else nproc


def read_recipe(checkout: Path, rel: str, dest: Path) -> Path:
    """examples/llm_finetune/<rel> from the work tree, else from the git dir's HEAD."""
    src = checkout / "examples" / "llm_finetune" / rel
    text = (
        src.read_text()
        if src.is_file()
        else subprocess.check_output(
            ["git", f"--git-dir={_git_dir(checkout)}", "show", f"HEAD:examples/llm_finetune/{rel}"], text=True
        )
    )
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)
    return dest


# --- runs -------------------------------------------------------------------------------------


def common_overrides(recipe: RecipeFile, mode: str, artefacts: dict[str, Path], steps: int) -> list[str]:
    """The same for both trainers: local artefacts, gloo, the step count, the seeds, no checkpoints."""
    model = artefacts["model_bos" if mode == "as_written" else "model_eos"]
    out = [
        f"--model.pretrained_model_name_or_path={model}",
        *recipe.data_overrides(artefacts),
        "--dist_env.backend=gloo",
        f"--step_scheduler.max_steps={steps}",
        f"--seed={SEED}",
        f"--rng.seed={SEED}",
        "--checkpoint.enabled=false",
    ]
    return out + (list(FP32) if mode == "equal" else [])


def automodel_command(python: Path, file: Path, nproc: int, overrides: list[str], logs: Path) -> list[str]:
    torchrun = [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [
        *torchrun,
        "-m",
        "nemo_automodel.cli.app",
        str(file),
        *overrides,
        f"--checkpoint.checkpoint_dir={logs}",
    ]


def initial_adapter_command(
    python: Path, file: Path, nproc: int, overrides: list[str], out: Path
) -> list[str]:
    """AutoModel's own setup() of `file` with the training run's overrides; writes its initial adapter to `out`."""
    torchrun = [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*torchrun, str(INITIAL_ADAPTER), str(out), str(file), *overrides]


def initial_adapter_overrides(recipe: RecipeFile, mode: str, adapter: Path) -> list[str]:
    """Ours only: start from AutoModel's initial adapter (LoRA files, equal mode); a key AutoModel lacks."""
    return [f"--peft.initial_adapter={adapter}"] if recipe.lora and mode == "equal" else []


def ours_command(file: Path, nproc: int, overrides: list[str], logs: Path) -> list[str]:
    uv = shutil.which("uv") or "uv"
    return [uv, "run", "--frozen", "recipes", "train", str(file), "--nproc-per-node", str(nproc), *overrides, f"--output_dir={logs}"]  # fmt: skip


def automodel_steps(path: Path) -> list[Step]:
    """``training.jsonl``: 0-based steps; step time = tokens of the step / its tokens per second."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        Step(r["loss"], r["grad_norm"], r["num_label_tokens"], r["num_tokens_per_step"] / r["tps"])
        for r in rows
    ]


def ours_steps(path: Path) -> list[Step]:
    """``metrics.jsonl``: 1-based steps; ``num_tokens`` counts label tokens."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Step(r["loss"], r["grad_norm"], r["num_tokens"], r["step_time_s"]) for r in rows]


def _logged(cmd: list[str], *, log: Path, cwd: Path, what: str) -> int:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)
    start = time.perf_counter()
    with log.open("w") as fh:
        fh.write(" ".join(cmd) + "\n\n")
        fh.flush()
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    print(f"  {what}: exit {rc} in {time.perf_counter() - start:.0f} s (log {log})", flush=True)
    return rc


def run_one(cmd: list[str], *, log: Path, cwd: Path, metrics: Path, trainer: str) -> Run:
    rc = _logged(cmd, log=log, cwd=cwd, what=trainer)
    if rc != 0 or not metrics.exists():
        return Run(trainer, error=f"exit {rc}, see {log}")
    return Run(trainer, steps=(automodel_steps if trainer == "automodel" else ours_steps)(metrics))


# --- report -----------------------------------------------------------------------------------


def median_time(steps: list[Step]) -> float | None:
    """Median step time after the first step (which carries warm-up)."""
    times = [s.time_s for s in steps[1:]]
    return statistics.median(times) if times else None


def summary_row(name: str, mode: str, nproc: int, am: Run, ours: Run) -> dict[str, object]:
    """One file and mode: the largest per-step differences and the median step times."""
    n = min(len(am.steps), len(ours.steps))
    pairs = list(zip(am.steps[:n], ours.steps[:n], strict=True))
    t_am, t_ours = median_time(am.steps), median_time(ours.steps)
    return {
        "file": name,
        "mode": mode,
        "nproc": nproc,
        "steps": n,
        "max_loss_diff": max((abs(a.loss - o.loss) for a, o in pairs), default=None),
        "max_grad_norm_diff": max((abs(a.grad_norm - o.grad_norm) for a, o in pairs), default=None),
        "labels_equal": all(a.label_tokens == o.label_tokens for a, o in pairs) if pairs else None,
        "automodel_s": t_am,
        "ours_s": t_ours,
        "ratio": (t_ours / t_am) if t_am and t_ours else None,
        "error": am.error or ours.error,
    }


def _fmt(value: object, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec)


def step_table(am: Run, ours: Run) -> str:
    lines = [
        "| step | AutoModel loss | ours loss | abs diff | grad norm AM / ours | label tokens AM / ours | step s AM / ours |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i, (a, o) in enumerate(zip(am.steps, ours.steps, strict=False), start=1):
        lines.append(
            f"| {i} | {a.loss:.7f} | {o.loss:.7f} | {abs(a.loss - o.loss):.1e} | {a.grad_norm:.6f} / {o.grad_norm:.6f} "
            f"| {a.label_tokens} / {o.label_tokens} | {a.time_s:.2f} / {o.time_s:.2f} |"
        )
    return "\n".join(lines)


def summary_table(rows: list[dict[str, object]]) -> str:
    lines = [
        "| file | labels / precision | processes | steps | max abs loss diff | max abs grad-norm diff | label tokens equal | median step s AutoModel | median step s ours | ours / AutoModel |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if r["error"]:
            lines.append(f"| {r['file']} | {r['mode']} | {r['nproc']} | failed: {r['error']} |||||||")
            continue
        mode = (
            "as written (BOS tokenizer, each its default precision)"
            if r["mode"] == "as_written"
            else "equal labels, fp32 both"
            + (", AutoModel's initial adapter" if FILES[str(r["file"])].lora else "")
        )
        lines.append(
            f"| {r['file']} | {mode} | {r['nproc']} | {r['steps']} | {_fmt(r['max_loss_diff'], '.1e')} | {_fmt(r['max_grad_norm_diff'], '.1e')} "
            f"| {'yes' if r['labels_equal'] else 'no'} | {_fmt(r['automodel_s'], '.2f')} | {_fmt(r['ours_s'], '.2f')} | {_fmt(r['ratio'], '.2f')} |"
        )
    return "\n".join(lines)


def report(results: list[tuple[str, str, int, Run, Run]], *, header: str) -> str:
    rows = [summary_row(name, mode, nproc, am, ours) for name, mode, nproc, am, ours in results]
    parts = [header, "", summary_table(rows)]
    for name, mode, _, am, ours in results:
        if am.steps and ours.steps:
            parts += ["", f"### {name}, {mode}", "", step_table(am, ours)]
    return "\n".join(parts) + "\n"


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # lazy: transformers/torch only when artefacts are written (argument errors stay fast)
    from _automodel_peer_artefacts import write_artefacts

    work = args.work or Path(os.environ.get("TMPDIR", "/tmp")) / f"automodel_peer_{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    python = ensure_venv(args.venv)
    commit = checkout_commit(args.automodel_checkout)
    artefacts = write_artefacts(work / "artefacts", rows=args.rows)
    results = []
    for name in args.files:
        recipe = FILES[name]
        file = read_recipe(args.automodel_checkout, recipe.path, work / "files" / Path(recipe.path).name)
        nproc = processes(file, args.nproc)
        for mode in args.modes:
            print(f"{name} ({recipe.path}), {mode}, {nproc} processes", flush=True)
            overrides = common_overrides(recipe, mode, artefacts, args.steps)
            run_dir = work / "runs" / f"{name}_{mode}"
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            am_logs, ours_logs = run_dir / "automodel", run_dir / "ours"
            adapter = run_dir / "automodel_initial_adapter"
            ours_overrides = [*overrides, *initial_adapter_overrides(recipe, mode, adapter)]
            if ours_overrides != overrides:
                cmd = initial_adapter_command(python, file, nproc, [*overrides, f"--checkpoint.checkpoint_dir={am_logs}"], adapter)  # fmt: skip
                rc = _logged(cmd, log=run_dir / "automodel_initial_adapter.log", cwd=run_dir, what="automodel initial adapter")  # fmt: skip
                if rc != 0 or not (adapter / "adapter_model.safetensors").is_file():
                    error = f"initial adapter: exit {rc}, see {run_dir / 'automodel_initial_adapter.log'}"
                    results.append(
                        (name, mode, nproc, Run("automodel", error=error), Run("ours", error=error))
                    )
                    continue
            am = run_one(
                automodel_command(python, file, nproc, overrides, am_logs),
                log=run_dir / "automodel.log",
                cwd=run_dir,
                metrics=am_logs / "training.jsonl",
                trainer="automodel",
            )
            ours = run_one(
                ours_command(file, nproc, ours_overrides, ours_logs),
                log=run_dir / "ours.log",
                cwd=ROOT,
                metrics=ours_logs / "metrics.jsonl",
                trainer="ours",
            )
            results.append((name, mode, nproc, am, ours))
    header = (
        f"NeMo AutoModel 0.7.0 vs `recipes train`, up to {args.nproc} processes, {args.steps} steps, {args.rows} rows; "
        f"files from NVIDIA-NeMo/Automodel {commit[:9]} examples/llm_finetune; work dir {work}"
    )
    text = report(results, header=header)
    print(text)
    if args.report:
        args.report.write_text(text)
    return 0 if all(not (am.error or ours.error) for *_, am, ours in results) else 1


if __name__ == "__main__":
    sys.exit(main())
