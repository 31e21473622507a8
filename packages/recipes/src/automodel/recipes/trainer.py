"""The training loop: config -> composed model -> steps, validation, metrics, checkpoints.

The loss of a step is ``sum of token CE / global number of label tokens`` (over every dp and cp
rank and every micro-batch of the step), and data-parallel gradients are SUMMED
(``gradient_divide_factor=1.0``), so one process, any layout and any accumulation produce the
same loss and gradients for the same global batch.
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from automodel.data.api import build_loader as build_train_loader
from automodel.data.batches import Batch, read_batch
from automodel.data.first_rows import first_rows
from automodel.data.run_length import data_end_line
from automodel.data.sft import PAD_MULTIPLE, BatchLength, batch_length_rows
from automodel.data.token_ids import check_tokenizer_ids
from automodel.mesh import MeshContext
from automodel.recipes._dist_setup import setup_distributed
from automodel.recipes.checkpoint import Checkpointer, TrainingState
from automodel.recipes.checkpoint.paths import CONSOLIDATED_DIR
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.data import build_packed_dataset
from automodel.recipes.data.launch_data import model_vocab, run_tokenizer
from automodel.recipes.data.row_counts import check_rows_to_evaluate
from automodel.recipes.elastic import announce_start
from automodel.recipes.errors import ConfigError
from automodel.recipes.instantiate import locate
from automodel.recipes.kernels.apply import apply_kernels, check_linear_loss_bound
from automodel.recipes.kernels.float8 import precompute_scales
from automodel.recipes.launch_check import launch_world_size
from automodel.recipes.layout_report import describe_rank, summary_lines, write_rank_report
from automodel.recipes.loss import masked_cross_entropy_sum
from automodel.recipes.lr_schedule import build_lr_scheduler
from automodel.recipes.metrics import MetricsWriter, peak_memory_bytes
from automodel.recipes.model import build_meta_model
from automodel.recipes.model_inputs import position_id_offset
from automodel.recipes.output_head import HeadLoss, HeadPlan, build_head_loss
from automodel.recipes.packed_probe import apply_packed_probe
from automodel.recipes.parallelisms import (
    BatchRun,
    MicroBatch,
    Parallelism,
    axis_sizes,
    batch_rank,
    batch_ranks,
    mesh_roles,
    parallelisms,
    role_group,
    sequence_length_divisor,
)
from automodel.recipes.parallelize import parallelize_model
from automodel.recipes.peft import apply_lora
from automodel.recipes.resolved_run import ResolvedRun, check_rank, resolve_run
from automodel.recipes.run_lock import hold_output_dir, run_checkpoint_dir
from automodel.recipes.strategies import get_strategy
from automodel.recipes.trackers import Trackers


class NonFiniteError(FloatingPointError):
    """The loss or the gradient norm of a step is NaN or infinite."""


class CollectiveTimeoutError(RuntimeError):
    """A collective waited longer than ``dist_env.timeout_minutes``: another rank died or hangs."""


def is_collective_timeout(error: BaseException, *, waited_s: float, timeout_s: float) -> bool:
    """Whether `error`, raised after `waited_s` seconds of a step, is a collective time-out.

    torch raises `torch.distributed.DistError` subclasses for backend failures (NCCL's watchdog);
    gloo raises a plain RuntimeError when a collective exceeds the process group's time-out, so a
    RuntimeError counts only when the step had already waited at least that long.
    """
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and waited_s >= timeout_s


class StepScaledLoss:
    """The pipeline's per-micro-batch loss: ``loss_fn(logits, labels) / divisor``.

    A pipeline schedule calls its loss function itself, so the step's divisor (the global
    label-token count) is set here by the loop before each step (`set_divisor`), and reset to 1
    for evaluation.
    """

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        self.divisor: torch.Tensor | float = 1.0

    def set_divisor(self, divisor: torch.Tensor | float) -> None:
        self.divisor = divisor

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels) / self.divisor


class StepResult(NamedTuple):
    """A step's numbers, still on the device: reading them waits for the step to finish, so the
    loop reads step N while step N+1 is queued (`fetch`), and at once only where it must."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    tokens: torch.Tensor

    def fetch(self, *, step: int) -> tuple[float, float, int]:
        """``(loss, grad_norm, tokens)`` as numbers; `NonFiniteError` naming `step` if not finite."""
        loss, norm = float(self.loss), float(self.grad_norm)
        if not math.isfinite(loss) or not math.isfinite(norm):
            raise NonFiniteError(
                f"step {step}: non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} "
                f"(loss={loss}, grad_norm={norm}); stopping"
            )
        return loss, norm, int(self.tokens)


@dataclass
class TrainResult:
    """Per-step numbers of a run (the same on every rank), for tests and callers."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    val_losses: dict[int, float] = field(default_factory=dict)
    steps: int = 0
    output_dir: str = ""


def _all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


def batch_share(mesh: MeshContext) -> int:
    """This rank's share of each batch's rows (`roles.batch_rank` over the row-splitting axes)."""
    return batch_rank(mesh, mesh_roles().batch_axes)


class Trainer:
    """Owns one run: built by `build`, driven by `train`; every method is collective over ranks."""

    def __init__(self, run: ResolvedRun | RecipeConfig) -> None:
        #: the resolved run (`resolved_run.resolve_run`); a bare config is resolved by `build`
        self.run = run if isinstance(run, ResolvedRun) else None
        self.cfg = run.cfg if isinstance(run, ResolvedRun) else run
        self.step = 0  # optimizer steps done (restored from a checkpoint by `train`)
        self.pipeline_loss = StepScaledLoss(self.cfg.loss_fn)
        #: run after every optimizer step (fp8: the float8 scales of the next all-gathers)
        self.post_step_hooks: list[Callable[[], None]] = []

    # ---- construction --------------------------------------------------------------------
    def build(self) -> None:
        """Resolve (unless handed a resolved run), then this rank's process group, data, model,
        optimizers; the pre-launch checks ran in `resolve_run`, a rank checks only its own facts."""
        run = self._resolve()
        cfg = self.cfg = run.cfg
        self.hf_config = run.hf_config
        apply_packed_probe(
            cfg
        )  # transformers' per-layer packed-row probe: constant False when no row is packed
        self._setup_process_group(run)
        self._build_data()
        model = self._build_model(run)
        kernel_lines = apply_kernels(model, cfg=cfg, layout=self.mesh.layout, head_loss=self.head_loss)
        self.pm = parallelize_model(
            model,
            mesh=self.mesh,
            section=cfg.distributed,
            device=self.device,
            seed=cfg.seed,
            pipeline_loss_fn=self.pipeline_loss,
            pretrained_path=cfg.model.pretrained_path,
            allow_pickle_weights=cfg.model.allow_pickle_weights,
            peft=cfg.peft,
        )
        self._build_optimizers()
        self.head_loss.bind(self.pm.parts, unwrap=self.pm.strategy.unwrap)
        check_linear_loss_bound(self.head_loss)
        if cfg.fp8.enabled and cfg.fp8.precompute_float8_dynamic_scale_for_fsdp:
            self.post_step_hooks.append(precompute_scales(self.pm.parts))
        if self.rank == 0:
            print("\n".join([*kernel_lines, self.head_loss.describe()]), file=sys.stderr, flush=True)
        self._report_layout()
        if cfg.rng.ranked:  # dropout masks per data-parallel replica (AutoModel's StatefulRNG ranked)
            torch.manual_seed(cfg.seed + batch_share(self.mesh))
        if self.rank == 0 and cfg.notes:
            print("\n".join(f"note: {line}" for line in cfg.notes), file=sys.stderr, flush=True)

    def _resolve(self) -> ResolvedRun:
        """The run this rank trains: the one it was handed, else resolved here (the Python API in a
        process no launcher resolved for: every check, before the process group)."""
        if self.run is None:
            self.run = resolve_run(self.cfg, world_size=launch_world_size(), this_machine=True)
        return self.run

    def _setup_process_group(self, run: ResolvedRun) -> None:
        """This rank's process group and meshes, checked against the run's world size."""
        cfg = run.cfg
        setup = setup_distributed(
            cfg.distributed, backend=cfg.dist_env.backend, timeout_minutes=cfg.dist_env.timeout_minutes
        )
        check_rank(run, world_size=setup.world_size)
        self.mesh, self.device, self.rank = setup.mesh, setup.device, setup.rank
        announce_start(output_dir=cfg.output_dir)  # after a restart of torchrun's agent: what changed

    def _build_data(self) -> None:
        """Tokenizer, this dp rank's training loader, the validation rows and the run's length."""
        cfg = self.cfg
        self.tokenizer = run_tokenizer(cfg)
        self.vocab_size, vocab_key = model_vocab(self.hf_config)  # a multimodal model's text decoder's
        check_tokenizer_ids(
            self.tokenizer, vocab_size=self.vocab_size, path=cfg.tokenizer.path, vocab_key=vocab_key
        )
        ss = cfg.step_scheduler
        seq = cfg.packed_sequence.packed_sequence_size
        limit = cfg.packed_sequence.max_packs
        length = self._batch_length()
        dataset = batch_length_rows(
            build_packed_dataset(cfg.dataset, self.tokenizer, packed_sequence_size=seq, seed=cfg.seed), length
        )
        try:
            self.loader = build_train_loader(
                dataset if hasattr(dataset, "loader") else first_rows(dataset, limit),
                global_batch_size=ss.global_batch_size,
                local_batch_size=ss.local_batch_size,
                dp_rank=batch_share(self.mesh),
                dp_size=batch_ranks(self.mesh.layout),
                seed=cfg.seed,
                shuffle=cfg.dataloader.shuffle,
                vocab_size=self.vocab_size,
            )
        except ValueError as e:
            raise ConfigError("step_scheduler.global_batch_size", ss.global_batch_size, str(e)) from None
        self.val_dataset = (
            None
            if cfg.validation_dataset is None
            else first_rows(
                batch_length_rows(
                    build_packed_dataset(
                        cfg.validation_dataset, self.tokenizer, packed_sequence_size=seq, seed=cfg.seed
                    ),
                    length,
                ),
                limit,
            )
        )
        if cfg.validation_dataset is not None and self.val_dataset is not None:
            # counted before launch unless its kind or tokenizer is counted only here: one rule
            check_rows_to_evaluate(cfg.validation_dataset, rows=len(self.val_dataset))
        if self.val_dataset is not None and len(self.val_dataset) < ss.global_batch_size and self.rank == 0:
            print(
                f"note: validation_dataset has {len(self.val_dataset)} rows, fewer than "
                f"step_scheduler.global_batch_size={ss.global_batch_size}: evaluated as one smaller batch "
                "(the loss is per label token)",
                file=sys.stderr,
                flush=True,
            )
        # a stream has no length: its run is max_steps long (required for it, `rules`)
        steps_per_epoch = self.loader.steps_per_epoch or ss.max_steps
        assert steps_per_epoch is not None
        self.steps_per_epoch = steps_per_epoch
        total = steps_per_epoch * ss.num_epochs
        self.total_steps = min(total, ss.max_steps) if ss.max_steps is not None else total

    def _batch_length(self) -> BatchLength | None:
        """How long a micro-batch of one-example SFT rows is: its longest example rounded up to
        the least common multiple of `PAD_MULTIPLE` and what the layout needs (`sequence_length_divisor`),
        in power-of-two buckets when layers are compiled. None (rows of ``seq_length``, as the
        start-up note says) under pipeline parallelism: its stages exchange fixed-shape buffers."""
        cfg = self.cfg
        if cfg.distributed.pipeline_config is not None:
            return None
        sc = cfg.distributed.strategy_config
        return BatchLength(
            multiple=math.lcm(PAD_MULTIPLE, sequence_length_divisor(cfg.distributed, self.mesh.layout)),
            buckets="enable_compile" in sc.enabled_layer_flags,
        )

    def _build_model(self, run: ResolvedRun) -> torch.nn.Module:
        """The meta-device model (the one the checks ran on when this process resolved the run,
        else built once here), with LoRA, its position offset and the loss."""
        cfg = run.cfg
        model = run.take_meta_model()
        if model is None:  # resolved in another process (the launcher): one build in this one
            model = build_meta_model(
                self.hf_config, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code
            )
        torch.manual_seed(cfg.seed)
        self.lora = None
        if cfg.peft is not None:  # LoRA on the meta model: every parallelism below composes with it
            self.lora = apply_lora(model, section=cfg.peft)
        self.position_offset = position_id_offset(model)
        self.head_loss = self._build_head_loss(model)
        return model

    def _build_optimizers(self) -> None:
        """One optimizer (over the trainable parameters) and LR scheduler per model part."""
        cfg = self.cfg
        opt_cls = locate("optimizer._target_", cfg.optimizer.target)
        # Only trainable parameters (all of them, or the LoRA adapters) reach the optimizer.
        self.optimizers = [
            self.pm.prepare_optimizer(
                opt_cls([p for p in part.parameters() if p.requires_grad], **cfg.optimizer.kwargs), part
            )
            for part in self.pm.parts
        ]
        base_lr = cfg.optimizer.kwargs["lr"]
        self.schedulers = [
            build_lr_scheduler(o, section=cfg.lr_scheduler, base_lr=base_lr, total_steps=self.total_steps)
            for o in self.optimizers
        ]
        # The optimizers' parameters: the ones whose gradients are clipped and stepped (megatron-fsdp
        # swaps module parameters between forward and step; the optimizer holds the stepped ones).
        self.params = [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]

    def _build_head_loss(self, model: torch.nn.Module) -> HeadLoss:
        """The loss (chunked over the head's weight, or on logits) for the loop and the pipeline."""
        head_loss = build_head_loss(self.cfg.loss_fn, model=model, logits_loss=masked_cross_entropy_sum)
        strategy = self.cfg.distributed.strategy
        if not get_strategy(strategy).head_weight_readable and head_loss.plan.chunked:
            head_loss.plan = HeadPlan(None, reason=f"distributed.strategy {strategy}")
        self.pipeline_loss.loss_fn = head_loss
        return head_loss

    def _report_layout(self) -> None:
        """Print what this rank holds, one line per parallelism (every rank), and write
        ``<output_dir>/layout/rank_<N>.json`` for the ranks ``logging.layout_report`` names."""
        report = describe_rank(
            parts=self.pm.parts,
            mesh=self.mesh,
            strategy=self.pm.strategy,
            resolved=self.pm.resolved,
        )
        section = self.cfg.distributed
        lines = summary_lines(
            report, axis_sizes=axis_sizes(section, self.mesh.layout), strategy=self.pm.strategy
        )
        if section.chosen_because is not None:  # the YAML did not name the strategy: say why this one
            lines.append(f"[rank {self.rank}] strategy {section.strategy}: {section.chosen_because}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        which = self.cfg.logging.layout_report
        if which == "all" or (which == "rank0" and self.rank == 0):
            write_rank_report(report, output_dir=Path(self.cfg.output_dir))

    # ---- one step ------------------------------------------------------------------------
    def _micro_batch_loss(
        self, batch: Batch, *, divisor: torch.Tensor | None, backward: bool
    ) -> torch.Tensor:
        """Sum of token losses of one micro-batch on this rank (its CP shard), over `divisor`.

        With `backward` the loss is back-propagated here, inside the CP context: context-parallel
        attention must run its backward under the same context as its forward (torch's CP
        dispatches the backward kernels there too). Returns the detached loss.
        """
        model = self.pm.parts[0]
        fields = {
            "input_ids": batch.input_ids.to(self.device),
            "labels": batch.labels.to(self.device),
            "position_ids": batch.position_ids.to(self.device),
        }
        ctx, fields, extra = self._shard_batch(fields)
        with ctx(), self.head_loss.capturing():
            logits = model(
                input_ids=fields["input_ids"],
                position_ids=fields["position_ids"] + self.position_offset,
                use_cache=False,
                **extra,
            ).logits
            loss = self.head_loss(logits, fields["labels"])
            if divisor is not None:
                loss = loss / divisor
            if backward:
                loss.backward()
        return loss.detach()

    def _batch_runner(self) -> Parallelism | None:
        """The parallelism that runs a whole local batch itself (pp's schedule), if any."""
        return next((p for p in parallelisms() if p.runs_local_batch(self.pm)), None)

    def _local_batch_loss_sum(self, runner: Parallelism, batch: Batch, *, train: bool) -> torch.Tensor:
        """One local batch run by `runner` (`Parallelism.run_local_batch`); its loss (already over
        the step's tokens when training) summed over the runner's group."""
        fields = {
            "input_ids": batch.input_ids.to(self.device),
            "labels": batch.labels.to(self.device),
            "position_ids": batch.position_ids.to(self.device),
        }
        ctx, fields, extra = self._shard_batch(fields)
        fields["position_ids"] = fields["position_ids"] + self.position_offset
        with ctx(), self.head_loss.capturing():
            return runner.run_local_batch(MicroBatch(fields=fields, extra=extra), model=self.pm, train=train)

    def _shard_batch(
        self, fields: dict[str, torch.Tensor]
    ) -> tuple[Callable[[], Any], dict[str, torch.Tensor], dict[str, Any]]:
        """This rank's share of `fields` after every parallelism's batch transform
        (`Parallelism.shard_batch`: CP's sequence split), with the context its attention runs in."""
        run = BatchRun(
            mesh=self.mesh,
            resolved=self.pm.resolved,
            pad_token_id=self.tokenizer.pad_token_id,
            packed=self.cfg.packed_sequence.packed_sequence_size > 0,
        )
        batch = MicroBatch(fields=fields)
        for parallelism in parallelisms():
            batch = parallelism.shard_batch(batch, run=run)
        return batch.context, batch.fields, batch.extra

    def train_step(self, batches: list[Batch]) -> StepResult:
        """Forward/backward every micro-batch, clip, step; no host-device synchronisation.

        Returns the loss, gradient norm and global token count on the device (`StepResult.fetch`
        reads and checks them). The optimizer steps before the non-finite check runs: a NaN step
        is reported when its numbers are read, which `train` does before any checkpoint is written.
        """
        local_tokens = sum(int((b.labels != -100).sum()) for b in batches)
        # a fill, not a host-to-device copy
        tokens = _all_reduce_sum(
            torch.full((), float(local_tokens), device=self.device),
            role_group(self.mesh, mesh_roles().batch_axes),
        )
        loss_sum = torch.zeros((), device=self.device)
        self.pipeline_loss.set_divisor(tokens)
        runner = self._batch_runner()
        for i, batch in enumerate(batches):
            if runner is not None:
                loss_sum += self._local_batch_loss_sum(runner, batch, train=True)
                continue
            with self.pm.grad_sync(is_last_microbatch=i == len(batches) - 1):
                loss_sum += self._micro_batch_loss(batch, divisor=tokens, backward=True)
        for parallelism in parallelisms():
            parallelism.finish_backward(self.pm)
        loss_sum = _all_reduce_sum(loss_sum, role_group(self.mesh, mesh_roles().loss_axes))
        grad_norm = self._clip_grad_norm()
        for opt in self.optimizers:
            opt.step()
        for hook in self.post_step_hooks:
            hook()
        for sched in self.schedulers:
            sched.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return StepResult(loss_sum, grad_norm, tokens)

    def _clip_grad_norm(self) -> torch.Tensor:
        """The global gradient norm before clipping to ``clip_grad_norm.max_norm`` (the strategy's)."""
        return self.pm.strategy.clip_grad_norm(
            self.params,
            max_norm=self.cfg.clip_grad_norm.max_norm,
            mesh=self.mesh,
            counted_ids=self.pm.norm_parameter_ids(),
        )

    @torch.no_grad()
    def validate(self) -> float:
        """Mean token CE over the first `val_batches` global batches of the validation rows (all of
        them when None, as AutoModel), the last one smaller when the rows run out.

        Every rank runs the same number of micro-batches of ``local_batch_size`` rows, so the
        collectives inside a forward (FSDP's all-gathers, a pipeline's sends) match on every rank:
        rows past the end are filler rows without labels (`_validation_batch`), which add nothing
        to the loss sum or the token count, so the mean stays exact per label token."""
        assert self.val_dataset is not None
        ss = self.cfg.step_scheduler
        for part in self.pm.parts:
            part.eval()
        gbs, lbs = ss.global_batch_size, ss.local_batch_size
        rows = len(self.val_dataset)
        n_batches = -(-rows // gbs)
        if ss.val_batches is not None:
            n_batches = min(ss.val_batches, n_batches)
        per_rank, rank = gbs // batch_ranks(self.mesh.layout), batch_share(self.mesh)
        loss_sum = torch.zeros((), device=self.device)
        tokens = torch.zeros((), device=self.device)
        self.pipeline_loss.set_divisor(1.0)
        runner = self._batch_runner()
        for b in range(n_batches):
            # the largest share of this global batch (dp rank 0's): every rank runs as many
            largest = min(per_rank, rows - b * gbs)
            start = b * gbs + rank * per_rank
            for mb in range(-(-largest // lbs)):
                first = start + mb * lbs
                indices = [i for i in range(first, first + lbs) if i < min(rows, start + per_rank)]
                batch = self._validation_batch(indices, rows=lbs)
                if runner is not None:
                    loss_sum += self._local_batch_loss_sum(runner, batch, train=False).float()
                else:
                    loss_sum += self._micro_batch_loss(batch, divisor=None, backward=False).float()
                tokens += float((batch.labels != -100).sum())
        loss_sum = _all_reduce_sum(loss_sum, role_group(self.mesh, mesh_roles().loss_axes))
        tokens = _all_reduce_sum(tokens, role_group(self.mesh, mesh_roles().batch_axes))
        for part in self.pm.parts:
            part.train()
        return float(loss_sum / tokens)

    def _validation_batch(self, indices: list[int], *, rows: int) -> Batch:
        """The validation rows `indices`, filled up to `rows` rows with copies of a row whose labels
        are all -100 (no loss, no token): a rank past the end of the rows still runs the forward."""
        assert self.val_dataset is not None
        batch = read_batch(self.val_dataset, indices or [0], vocab_size=self.vocab_size)
        real = len(indices)
        if real == rows:
            return batch
        fill = rows - real
        labels = batch.labels[:real]
        filler = torch.full((fill, batch.labels.shape[1]), -100, dtype=batch.labels.dtype)
        return Batch(
            input_ids=torch.cat([batch.input_ids[:real], batch.input_ids[:1].expand(fill, -1)]),
            labels=torch.cat([labels, filler]),
            position_ids=torch.cat([batch.position_ids[:real], batch.position_ids[:1].expand(fill, -1)]),
        )

    # ---- the run -------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Resume (or start) and train to the end; rank 0 holds the output_dir lock meanwhile."""
        cfg = self.cfg
        with hold_output_dir(cfg.output_dir, rank=self.rank, checkpoint_dir=run_checkpoint_dir(cfg)):
            return self._train()

    def _train(self) -> TrainResult:
        out = Path(self.cfg.output_dir)
        ckpt, state = self._start(out)
        log = _StepLog(self, out=out)
        consolidated, failed = None, True
        try:
            while self.step < self.total_steps:
                if self._one_step(log, ckpt=ckpt, state=state):
                    break  # pre-empted: saved, stop
            log.finish()
            if self.rank == 0 and (line := self._data_end_line()) is not None:
                print(line, file=sys.stderr, flush=True)
            if ckpt is not None:
                assert state is not None
                state.step = self.step
                saved = ckpt.save(state, last=self.step == self.total_steps)
                if saved is not None and (saved / CONSOLIDATED_DIR).is_dir():
                    consolidated = saved / CONSOLIDATED_DIR
            failed = False
        finally:
            log.close(checkpoint=consolidated, failed=failed)
            if ckpt is not None:
                ckpt.close()
        log.result.steps = self.step
        return log.result

    def _data_end_line(self) -> str | None:
        return data_end_line(
            step=self.step, steps_per_epoch=self.steps_per_epoch, section=self.cfg.step_scheduler
        )

    def _start(self, out: Path) -> tuple[Any, Any]:
        """Write the run's config, restore the newest checkpoint (if any) and say what the run
        starts from; returns the checkpointer and the training state (None, None without)."""
        is_main = self.rank == 0
        if is_main:
            out.mkdir(parents=True, exist_ok=True)
            (out / "config.yaml").write_text(yaml.safe_dump(self.cfg.raw, sort_keys=False))
        ckpt, state = self._checkpointer(out)
        if ckpt is not None:
            ckpt.restore(state)
            self.step = state.step
        if is_main:
            print(_resume_line(ckpt, step=self.step), file=sys.stderr, flush=True)
            if ckpt is not None and ckpt.startup_line:
                print(ckpt.startup_line, file=sys.stderr, flush=True)
        return ckpt, state

    def _one_step(self, log: _StepLog, *, ckpt: Checkpointer | None, state: TrainingState | None) -> bool:
        """One optimizer step, its numbers queued (validated / checked when due), then the
        checkpoints due after it; True when pre-emption saved and the run must stop."""
        ss = self.cfg.step_scheduler
        started = time.perf_counter()
        lr = self.schedulers[0].get_last_lr()[0]
        numbers = self._timed_step(log, started=started)
        self.step += 1
        log.queue(
            numbers,
            {
                "step": self.step,
                "lr": lr,
                "step_time_s": time.perf_counter() - started,
                "peak_mem_bytes": peak_memory_bytes(self.device),
            },
        )
        final = self.step == self.total_steps
        validate = self.val_dataset is not None and (
            (ss.val_every_steps and self.step % ss.val_every_steps == 0) or final
        )
        epoch_end = ss.save_checkpoint_every_epoch and self.step % self.steps_per_epoch == 0
        saving = ckpt is not None and (
            ckpt.preempted or epoch_end or (ss.ckpt_every_steps and self.step % ss.ckpt_every_steps == 0)
        )
        if validate or saving or final:
            log.finish(validate=validate)  # checked before any checkpoint of this step is written
        if ss.gc_every_steps and self.step % ss.gc_every_steps == 0:
            gc.collect()
        if ckpt is None:
            return False
        assert state is not None
        state.step = self.step
        ckpt.maybe_save(state, every_steps=ss.ckpt_every_steps)
        if epoch_end and not final:
            ckpt.save(state)  # the final step is saved once, by `_train`, as the last one
        if ckpt.preempted:
            ckpt.save(state)
            return True
        return False

    def _timed_step(self, log: _StepLog, *, started: float) -> StepResult:
        """`train_step` on the next batches, then the previous step's numbers read (step N's are
        read once step N+1 is queued: the host never waits for the device in between; a
        non-finite step N stops the run one step later); a collective time-out says so."""
        try:
            numbers = self.train_step(self.loader.next_step())
            log.finish()
        except RuntimeError as e:
            minutes = self.cfg.dist_env.timeout_minutes
            waited_s = time.perf_counter() - started
            if not is_collective_timeout(e, waited_s=waited_s, timeout_s=minutes * 60):
                raise
            raise CollectiveTimeoutError(
                f"rank {self.rank}, step {self.step + 1}: a collective timed out after "
                f"dist_env.timeout_minutes={minutes}; another rank died or "
                f"hangs ({type(e).__name__}: {e})"
            ) from e
        return numbers

    def _checkpointer(self, out: Path) -> tuple[Any, Any]:
        if not self.cfg.checkpoint.enabled:
            return None, None

        state = TrainingState(
            model_parts=self.pm.parts,
            optimizers=self.optimizers,
            lr_schedulers=self.schedulers,
            dataloader=self.loader,
            step=0,
            hf_config=self.hf_config,
            tokenizer=self.tokenizer,
            strategy=self.pm.strategy,
        )
        checkpointer = Checkpointer(
            self.cfg.checkpoint,
            output_dir=out,
            mesh=self.mesh,
            lora=self.lora,
            base_model_name_or_path=self.cfg.model.pretrained_path,
        )
        return checkpointer, state


class _StepLog:
    """The steps' numbers: a step's are read (`finish`) only once the next one is queued or when
    they are due (validation, a checkpoint, the end), then checked, validated if asked, and
    written to metrics.jsonl (rank 0) and the progress bar."""

    def __init__(self, trainer: Trainer, *, out: Path) -> None:
        cfg, is_main = trainer.cfg, trainer.rank == 0
        self.trainer = trainer
        self.metrics = MetricsWriter(
            out,
            enabled=is_main,
            tensorboard=cfg.logging.tensorboard,
            resumed_step=trainer.step,
            trackers=Trackers.start(cfg, enabled_here=is_main, resumed_step=trainer.step),
        )
        self.result = TrainResult(output_dir=str(out))
        self.bar = None
        if is_main and cfg.logging.progress_bar:
            self.bar = tqdm(
                total=trainer.total_steps, initial=trainer.step, desc="train", unit="step", dynamic_ncols=True
            )
        self.pending: tuple[StepResult, dict[str, Any]] | None = None

    def queue(self, numbers: StepResult, timing: dict[str, Any]) -> None:
        self.pending = (numbers, timing)

    def finish(self, *, validate: bool = False) -> None:
        """Read the pending step's numbers (waits for it), check them, validate if asked, write
        its record."""
        if self.pending is None:
            return
        (numbers, timing), self.pending = self.pending, None
        loss, norm, tokens = numbers.fetch(step=timing["step"])
        elapsed = timing["step_time_s"]
        record: dict[str, Any] = {
            "step": timing["step"],
            "loss": loss,
            "grad_norm": norm,
            "lr": timing["lr"],
            "num_tokens": tokens,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "step_time_s": elapsed,
            "peak_mem_bytes": timing["peak_mem_bytes"],
        }
        self.result.losses.append(loss)
        self.result.grad_norms.append(norm)
        if validate:
            record["val_loss"] = self.result.val_losses[record["step"]] = self.trainer.validate()
        self.metrics.write(record)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{record['lr']:.2e}")

    def close(self, *, checkpoint: Path | None = None, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.close()
        self.metrics.close(checkpoint=None if checkpoint is None else str(checkpoint), failed=failed)


def _resume_line(ckpt: Any, *, step: int) -> str:
    """What this run starts from: every run says it, so a resume is never silent."""
    if ckpt is None:
        return "fresh start (checkpointing disabled)"
    path = getattr(ckpt, "restored_from", None)
    if path is None:
        return f"fresh start (no complete checkpoint in {ckpt.root})"
    return f"resumed from step {step} ({path})"


def run_training(run: ResolvedRun | RecipeConfig) -> TrainResult:
    """Build and train `run` (a bare config is resolved in this process first); the process group
    is created if needed and left for the caller to destroy."""
    trainer = Trainer(run)
    trainer.build()
    return trainer.train()
