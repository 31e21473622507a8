"""The `recipes` console script: ``train``, ``validate``, ``plan``, ``preprocess``, ``generate`` and
``plot`` (and ``--version``).

Config mistakes exit with code 2 and one line ``error: <key>=<value>: <why>``, with no traceback,
no process left behind and nothing written; so does every other user mistake (`errors.is_user_error`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from automodel.mesh import detect_launch_env
from automodel.recipes import __version__
from automodel.recipes._quiet import quiet_known_notices
from automodel.recipes.errors import ConfigError, is_user_error
from automodel.recipes.lifetime import die_with_parent
from automodel.recipes.plot import plot_losses
from automodel.recipes.resume_check import check_config_changes

if TYPE_CHECKING:  # imported by the commands that need them (start-up, recipes --help)
    from automodel.recipes.config.recipe import RecipeConfig
    from automodel.recipes.node_watch import NodeWatch
    from automodel.recipes.resolved_run import ResolvedRun

EXIT_CONFIG_ERROR = 2


AUTOMODEL_DISTRIBUTIONS = (
    "automodel-recipes",
    "automodel-mesh",
    "automodel-fsdp2",
    "automodel-megatron-fsdp-adapter",
    "automodel-pipeline",
    "automodel-context-parallel",
    "automodel-moe-ep",
    "automodel-data",
)
THIRD_PARTY_REPORTED = ("torch", "transformers", "megatron-fsdp")


def version_report() -> str:
    """`recipes --version`: one `name version` line per automodel package, torch, transformers and
    megatron-fsdp ("not installed" where absent), read from the installed metadata (no imports)."""

    def one(name: str) -> str:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            if name == "automodel-recipes":  # running from a source tree: the pyproject's version
                return f"{name} {__version__}"
            return f"{name} not installed"

    return "\n".join(one(name) for name in (*AUTOMODEL_DISTRIBUTIONS, *THIRD_PARTY_REPORTED))


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            help="print the versions of the automodel packages, torch, transformers and megatron-fsdp, and exit",
        )

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_report())
        parser.exit()


_LOAD_FACTOR_FLAGS = ("--moe-load-factor", "--moe_load_factor")
_LOAD_FACTOR_OPTIONS: dict = {
    "type": float,
    "default": 1.0,
    "dest": "moe_load_factor",
    "help": "MoE with ep: the busiest ep rank's routed tokens over the mean (1: balanced; an untrained "
    "router measured ~1.4 on 2 ranks)",
}


def _check_load_factor(value: float) -> None:
    if not value >= 1.0:
        raise ConfigError(
            "--moe-load-factor", value, "must be >= 1 (the busiest ep rank's routed tokens over the mean)"
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="recipes", description="Train Hugging Face LMs with composable parallelism."
    )
    p.add_argument("--version", action=_VersionAction)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train from a YAML config (any --section.key=value overrides it)")
    t.add_argument("config")
    # launcher flags: None when not given (launch_plan refuses a given one the environment contradicts)
    t.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None, dest="nproc_per_node")
    t.add_argument("--nnodes", default=None)
    t.add_argument("--node-rank", "--node_rank", type=int, default=None, dest="node_rank")
    t.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, dest="rdzv_endpoint")
    t.add_argument("--rdzv-id", "--rdzv_id", default=None, dest="rdzv_id")
    t.add_argument(
        "--rdzv-timeout",
        "--rdzv_timeout",
        type=int,
        default=None,
        dest="rdzv_timeout",
        help="seconds the nodes wait for each other to join (default 600)",
    )
    t.add_argument("--max-restarts", "--max_restarts", type=int, default=None, dest="max_restarts")
    t.add_argument(
        "--resume-with-changes",
        "--resume_with_changes",
        action="store_true",
        dest="resume_with_changes",
        help="resume in an output_dir whose config.yaml differs from this config (else exit 2 listing the differences)",
    )
    # Set by the `recipes` launcher on the ranks it starts (see automodel.recipes.launch).
    t.add_argument("--launcher-error-dir", default=None, dest="launcher_error_dir", help=argparse.SUPPRESS)
    t.add_argument("--launcher-pid", type=int, default=None, dest="launcher_pid", help=argparse.SUPPRESS)
    t.add_argument("--launcher-resolved", default=None, dest="launcher_resolved", help=argparse.SUPPRESS)
    v = sub.add_parser("validate", help="resolve config and layout for --world-size ranks; no training")
    v.add_argument("config")
    v.add_argument("--world-size", "--world_size", type=int, default=None, dest="world_size")
    v.add_argument(*_LOAD_FACTOR_FLAGS, **_LOAD_FACTOR_OPTIONS)
    pn = sub.add_parser(
        "plan", help="rank layouts for a model on N GPUs, with memory and step-time estimates"
    )
    pn.add_argument(
        "--model",
        required=True,
        help="config.json, model dir, Hub id in the local cache, or examples/models name",
    )
    pn.add_argument("--gpus", type=int, required=True)
    pn.add_argument("--gpus-per-node", "--gpus_per_node", type=int, default=8, dest="gpus_per_node")
    pn.add_argument("--gpu-memory", "--gpu_memory", default="80GiB", dest="gpu_memory")
    pn.add_argument("--seq-len", "--seq_len", type=int, required=True, dest="seq_len")
    pn.add_argument("--global-batch", "--global_batch", type=int, default=None, dest="global_batch")
    pn.add_argument("--peft", default=None, help="lora: only the adapters have gradients and optimizer state")
    pn.add_argument("--top", type=int, default=10)
    pn.add_argument(
        "--nvlink-gbps",
        "--nvlink_gbps",
        type=float,
        default=450.0,
        dest="nvlink_gbps",
        help="GB/s per GPU per direction",
    )
    pn.add_argument(
        "--ib-gbps", "--ib_gbps", type=float, default=50.0, dest="ib_gbps", help="GB/s per GPU per direction"
    )
    pn.add_argument("--tflops", type=float, default=989.0, help="dense bf16 peak TFLOP/s per GPU")
    pn.add_argument(*_LOAD_FACTOR_FLAGS, **_LOAD_FACTOR_OPTIONS)
    g = sub.add_parser(
        "generate",
        help="continue a prompt with a consolidated checkpoint or a LoRA adapter directory (transformers generate)",
    )
    g.add_argument(
        "checkpoint", help="a consolidated/ directory, an HF model directory, or an adapter directory"
    )
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", "--max_new_tokens", type=int, default=64, dest="max_new_tokens")
    g.add_argument(
        "--do-sample", "--do_sample", action="store_true", dest="do_sample", help="sample (default: greedy)"
    )
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", "--top_p", type=float, default=1.0, dest="top_p")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--raw", action="store_true", help="send the prompt as is (no chat template or SFT prompt format)"
    )
    prep = sub.add_parser(
        "preprocess",
        help="tokenize jsonl/json/parquet/text files, folders or a cached Hub dataset into Megatron .bin/.idx shards",
    )
    prep.add_argument("inputs", nargs="+", help="files, folders, or a Hub dataset id in the local cache")
    prep.add_argument("--output", required=True, help="folder for shard_NNNNN.bin/.idx and manifest.json")
    prep.add_argument("--text-key", "--text_key", default="text", dest="text_key")
    prep.add_argument(
        "--config", default=None, help="a recipe YAML: use its tokenizer (tokenizer: or the model's own)"
    )
    prep.add_argument(
        "--tokenizer", default=None, help="a tokenizer directory or cached Hub id (default: bytes)"
    )
    prep.add_argument(
        "--trust-remote-code", "--trust_remote_code", action="store_true", dest="trust_remote_code"
    )
    prep.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 1))
    prep.add_argument("--shard-size-mb", "--shard_size_mb", type=float, default=128.0, dest="shard_size_mb")
    prep.add_argument("--no-progress", action="store_false", dest="progress")
    pl = sub.add_parser("plot", help="write <OUTPUT_DIR>/loss.png from metrics.jsonl")
    pl.add_argument("output_dir")
    pl.add_argument("--out", default=None)
    return p


_TRAIN_LAUNCHER_FLAGS = {
    "nproc-per-node", "nnodes", "node-rank", "rdzv-endpoint", "rdzv-id", "rdzv-timeout", "max-restarts",
    "resume-with-changes",
}  # fmt: skip


def _split_overrides(command: str, extra: list[str]) -> list[str]:
    for arg in extra:
        flag = arg[2:].partition("=")[0].replace("_", "-") if arg.startswith("--") else ""
        if command != "train" and flag in _TRAIN_LAUNCHER_FLAGS:
            hint = "; validate plans for --world-size N" if command == "validate" else ""
            raise ConfigError(
                arg, None, f"is a `recipes train` launcher option, not one of `recipes {command}`{hint}"
            )
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(arg, None, "unrecognized argument; overrides look like --section.key=value")
    return extra


def load_and_parse(config: str, overrides: list[str]):
    """Config file + overrides -> validated `RecipeConfig` (the path shared by train and validate)."""
    # lazy: start-up, recipes --help: api ~3 s
    from automodel.recipes.api import load_config

    return load_config(config, overrides=overrides)


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    # lazy: start-up, recipes --help: launch ~7 s
    from automodel.recipes.launch import launch_torchrun

    # lazy: start-up, recipes --help: launch_plan ~1 s
    from automodel.recipes.launch_plan import LAUNCHER_FLAGS, plan_launch

    # who starts the ranks, decided (or refused) before anything is read, written or started
    opts = plan_launch({key: getattr(args, key) for key in LAUNCHER_FLAGS})
    if opts is None:
        return _train_rank(args, overrides)
    cfg = load_and_parse(args.config, overrides)
    # lazy: start-up, recipes --help: resolved_run ~5 s
    from automodel.recipes.resolved_run import resolve_run

    # lazy: start-up, recipes --help: run_lock ~2.8 s
    from automodel.recipes.run_lock import acquire_run_lock, run_checkpoint_dir

    # the run resolved once for this machine (every check), before any process starts or anything
    # is written; the ranks get this value and check only their own process group. An elastic job:
    # once for each world it may shrink or grow to (each one's memory estimate checked too).
    run = resolve_run(cfg, world_size=opts.world_size, this_machine=True)
    runs = {opts.world_size: run}
    if opts.min_nnodes is not None:
        # lazy: start-up, recipes --help: elastic ~0.1 s
        from automodel.recipes.elastic import resolve_worlds

        runs = resolve_worlds(
            lambda world: (
                run
                if world == opts.world_size
                else resolve_run(
                    cfg, world_size=world, this_machine=True, read_files=False, hf_config=run.hf_config
                )
            ),
            min_nodes=opts.min_nnodes,
            max_nodes=opts.nnodes,
            ranks_per_node=opts.nproc_per_node,
            key="--nnodes",
        )
    # One launcher per node: on a single node it holds the output_dir lock for the whole job
    # (restarts included); on several nodes rank 0 takes it, wherever it runs.
    lock = (
        acquire_run_lock(output_dir=cfg.output_dir, checkpoint_dir=run_checkpoint_dir(cfg))
        if opts.nnodes == 1
        else None
    )
    try:
        if opts.node_rank == 0:  # node 0 checks the config against the output_dir's, for every node
            _check_resume(cfg, allow_changes=args.resume_with_changes)
        if opts.environment is not None:  # a pod: how its variables were read (checks passed)
            print(opts.environment, file=sys.stderr, flush=True)
        if opts.multi_process:
            return launch_torchrun(
                opts,
                [args.config, *overrides],
                runs=runs,
                saves_on_sigterm=cfg.checkpoint.enabled,
            )
        return _run_guarded(lambda: run, rank=0, error_dir=None)
    finally:
        if lock is not None:
            lock.release()


def _check_resume(cfg, *, allow_changes: bool) -> None:
    check_config_changes(cfg, allow_changes=allow_changes)


def _train_rank(args: argparse.Namespace, overrides: list[str]) -> int:
    """One rank of a job started by torchrun, srun or the `recipes` launcher (`--launcher-pid`).

    Under the `recipes` launcher the rank trains the run it resolved (`--launcher-resolved`);
    started by a plain torchrun or srun, each rank resolves the run itself (`api.train`)."""
    launch = detect_launch_env()
    if args.launcher_pid is not None or launch.launcher == "torchrun":
        die_with_parent(expected_parent=args.launcher_pid)  # never outlive the launcher

    def config() -> RecipeConfig | ResolvedRun:
        if args.launcher_resolved is not None:
            # lazy: start-up, recipes --help: elastic ~0.1 s
            from automodel.recipes.elastic import run_file

            # lazy: start-up, recipes --help: resolved_run ~5 s
            from automodel.recipes.resolved_run import ResolvedRun

            path = run_file(Path(args.launcher_resolved), launch.world_size)
            if not path.is_file():  # an elastic world the launcher did not resolve (ranks per node differ)
                raise ConfigError(
                    "WORLD_SIZE",
                    launch.world_size,
                    "the `recipes` launcher resolved this run for other world sizes; give every node "
                    "the same --nproc-per-node",
                )
            return ResolvedRun.load(path)
        cfg = load_and_parse(args.config, overrides)  # `api.train` resolves it in this rank
        if launch.rank == 0:  # no `recipes` launcher checked it
            _check_resume(cfg, allow_changes=args.resume_with_changes)
        return cfg

    # lazy: start-up, recipes --help: node_watch ~0.1 s
    from automodel.recipes.node_watch import NodeWatch

    watch = NodeWatch.from_env()  # a job of several nodes: say which one stopped, if one does
    try:
        return _run_guarded(
            config, rank=launch.rank, error_dir=args.launcher_error_dir, watch=watch and watch.start()
        )
    finally:
        if watch is not None:
            watch.stop()


def _run_guarded(
    config: Callable[[], RecipeConfig | ResolvedRun],
    *,
    rank: int,
    error_dir: str | None,
    watch: NodeWatch | None = None,
) -> int:
    """Train; a failure becomes a traceback file plus one line (or the launcher's report).

    Without a launcher, a user mistake (config, data, file system, checkpoint) prints one line and
    returns 2; other errors propagate with their traceback. Under the `recipes` launcher the rank
    prints nothing: the launcher summarizes every rank's report once the job has stopped.
    """
    # lazy: start-up, recipes --help: api ~3 s
    from automodel.recipes.api import train

    # lazy: start-up, recipes --help: rank_errors ~3 s
    from automodel.recipes.rank_errors import report_failure

    output_dir = None
    try:
        run = config()
        output_dir = run.output_dir
        result = train(run)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        report = report_failure(_lost_node(e, watch), rank=rank, output_dir=output_dir, error_dir=error_dir)
        if error_dir is not None:
            return report.exit_code
        if not report.line:
            raise
        print(f"error: {report.line}\n  (full traceback: {report.traceback_file})", file=sys.stderr)
        return report.exit_code
    if rank == 0:
        print(f"trained {result.steps} steps; metrics in {result.output_dir}/metrics.jsonl", file=sys.stderr)
    return 0


def _lost_node(e: BaseException, watch: NodeWatch | None) -> BaseException:
    """`e`, or, when another node of the job stopped (not a user mistake here), the error naming it."""
    # lazy: start-up, recipes --help: rank_errors ~3 s
    from automodel.recipes.rank_errors import EXIT_USER_ERROR, classify

    if watch is None or classify(e)[0] == EXIT_USER_ERROR:
        return e
    # lazy: start-up, recipes --help: node_watch ~0.1 s
    from automodel.recipes.node_watch import NodeStoppedError

    line = watch.failed_node_line()
    if line is None:
        return e
    lost = NodeStoppedError(line)
    lost.__cause__ = e
    return lost


def _validate(args: argparse.Namespace, overrides: list[str]) -> int:
    # lazy: start-up, recipes --help: plan ~4 s
    from automodel.recipes.plan import plan_layout

    cfg = load_and_parse(args.config, overrides)
    world = args.world_size if args.world_size is not None else 1
    if isinstance(world, int) and world < 1:
        raise ConfigError("--world-size", world, "must be >= 1")
    _check_load_factor(args.moe_load_factor)
    # validate plans for any machine: what this one cannot run is reported as a line, not refused
    _, _, lines = plan_layout(cfg, world_size=world, expert_load_factor=args.moe_load_factor)
    # lazy: start-up, recipes --help: row_counts, among plan's imports ~4 s
    from automodel.recipes.data.row_counts import validate_row_counts

    lines += validate_row_counts(cfg)  # the rows, where the data is here: refused as train refuses
    print("\n".join(lines))
    if cfg.refusals:  # runs on no machine: refused like train does, after the plan is shown
        # lazy: start-up, recipes --help: environment ~6 s
        from automodel.recipes.environment import refusal_error

        raise refusal_error(cfg.refusals)
    return 0


def _plan(args: argparse.Namespace, overrides: list[str]) -> int:
    # lazy: start-up, recipes --help: planning ~1.9 s
    from automodel.recipes.planning.propose import parse_bytes, plan

    # lazy: start-up, recipes --help: planning.roofline ~1.8 s
    from automodel.recipes.planning.roofline import Hardware

    if overrides:
        raise ConfigError(overrides[0], None, "plan takes no overrides")
    for key, value in (
        ("--top", args.top),
        ("--nvlink-gbps", args.nvlink_gbps),
        ("--ib-gbps", args.ib_gbps),
        ("--tflops", args.tflops),
    ):
        if value <= 0:
            raise ConfigError(key, value, "must be > 0")
    _check_load_factor(args.moe_load_factor)
    hw = Hardware(
        peak_flops=args.tflops * 1e12, nvlink_bytes_s=args.nvlink_gbps * 1e9, ib_bytes_s=args.ib_gbps * 1e9
    )
    _, lines = plan(
        model=args.model,
        gpus=args.gpus,
        seq_len=args.seq_len,
        gpus_per_node=args.gpus_per_node,
        gpu_memory=parse_bytes("--gpu-memory", args.gpu_memory),
        global_batch=args.global_batch,
        peft=args.peft,
        top=args.top,
        hardware=hw,
        expert_load_factor=args.moe_load_factor,
    )
    print("\n".join(lines))
    return 0


def _plot(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(overrides[0], None, "plot takes no overrides")
    print(plot_losses(args.output_dir, out_file=args.out))
    return 0


def _preprocess(args: argparse.Namespace, overrides: list[str]) -> int:
    # lazy: start-up, recipes --help: data.preprocess ~1.8 s
    from automodel.data.preprocess import preprocess

    if args.config is not None and args.tokenizer is not None:
        raise ConfigError("--tokenizer", args.tokenizer, "names the tokenizer like --config; give only one")
    tokenizer, trust = args.tokenizer, args.trust_remote_code
    if args.config is not None:
        cfg = load_and_parse(args.config, overrides)  # the run's tokenizer, as `train` resolves it
        tokenizer, trust = cfg.tokenizer.path, cfg.tokenizer.trust_remote_code
    elif overrides:
        raise ConfigError(overrides[0], None, "overrides need --config")
    elif tokenizer is not None and not os.path.isdir(os.path.expanduser(tokenizer)):
        # lazy: start-up, recipes --help: hub_cache ~0.1 s
        from automodel.data.hub_cache import resolve_local_or_cached

        tokenizer = str(resolve_local_or_cached(tokenizer, key="--tokenizer"))
    manifest = preprocess(
        inputs=args.inputs,
        output_dir=args.output,
        text_key=args.text_key,
        tokenizer_path=tokenizer,
        trust_remote_code=trust,
        workers=args.workers,
        shard_bytes=int(args.shard_size_mb * (1 << 20)),
        progress=args.progress,
    )
    t, run = manifest["totals"], manifest["last_run"]
    print(
        f"{t['shards']} shards, {t['documents']} documents, {t['tokens']} tokens ({manifest['dtype']}) in "
        f"{args.output} ({run['shards_written']} written, {run['shards_skipped']} already done); "
        f"train with dataset: {{source: megatron, paths: {args.output}}}",
        file=sys.stderr,
    )
    return 0


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    # lazy: start-up, recipes --help: generate ~1.2 s
    from automodel.recipes.generate import generate

    if overrides:
        raise ConfigError(overrides[0], None, "generate takes no overrides")
    out = generate(
        checkpoint=args.checkpoint,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        raw=args.raw,
    )
    print(out.text)
    return 0


def run_cli(argv: Sequence[str]) -> int:
    """Parse and run one command; returns the exit code (2 for config errors, one line on stderr)."""
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(list(argv))
    except SystemExit as e:
        return int(e.code or 0)
    try:
        overrides = _split_overrides(args.command, extra)
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            quiet_known_notices()  # after: its warning filter must come first
            return {
                "train": _train,
                "validate": _validate,
                "plan": _plan,
                "preprocess": _preprocess,
                "plot": _plot,
                "generate": _generate,
            }[args.command](args, overrides)
    except ValueError as e:  # ConfigError, DataError and the project's own ValueErrors; not a bug's
        if not is_user_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR


def main(argv: Sequence[str] | None = None) -> None:
    sys.exit(run_cli(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
