"""`AutoPipeline`: split a model into this rank's stages and drive them with a torch schedule.

Order inside `build`: choose the stage FQNs -> check every parameter lands in exactly one stage
-> cut this rank's stages -> cast (`dtype`) -> `parallelize_fn` per stage (TP, FSDP2, ... are the
caller's; this package imports none of them) -> DTensor boundary hooks (`dtensor_boundary`) ->
torch `PipelineStage`s -> the schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.nn.parallel import DistributedDataParallel

from automodel.mesh import MeshContext
from automodel.mesh.distributed import release_groups_at_teardown
from automodel.pipeline import torch_internals
from automodel.pipeline.config import PipelineConfig
from automodel.pipeline.ddp_stage import PipelineStageWithDDP, check_ddp_schedule, release_ddp_process_groups
from automodel.pipeline.dtensor_boundary import BoundaryLayouts, attach_boundary_layouts, normalize_layouts
from automodel.pipeline.forward_only import run_forward
from automodel.pipeline.hf import (
    hf_module_fqns_per_stage,
    make_causal_lm_stage,
    meta_stand_ins,
    renamed_tied_modules,
    tied_parameter_places,
    validate_hf_model_for_pipeline_support,
)
from automodel.pipeline.hf_structure import HFStructure
from automodel.pipeline.layout import (
    check_adjacent_stages_on_one_rank,
    check_stages_per_rank,
    num_stages_for,
    stage_ids_this_rank,
)
from automodel.pipeline.schedules import check_microbatch_count, read_csv_stage_layout
from automodel.pipeline.split import (
    check_parameter_coverage,
    is_transformers_model,
    modules_in_several_stages,
    split_module,
)
from automodel.pipeline.step_guard import (
    GuardedStage,
    OutputSpec,
    StepErrors,
    guard_loss,
    raise_if_any_failed,
)
from automodel.pipeline.tied import TiedParameters
from automodel.pipeline.wrappers import named_parameters_in_model, unwrap

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ParallelizeFn = Callable[..., nn.Module | None]

#: Label value of padded positions (the usual ignore_index of cross-entropy).
LABEL_PAD = -100


class AutoPipeline:
    """Builds the pipeline of one rank from a `MeshContext` (its ``pp`` axis) and a `PipelineConfig`."""

    def __init__(
        self, *, mesh: MeshContext, config: PipelineConfig, device: torch.device | None = None
    ) -> None:
        if not isinstance(config, PipelineConfig):
            raise ValueError(f"config must be a PipelineConfig, got {type(config).__name__}")
        self.mesh = mesh
        self.config = config
        self.device = device if device is not None else _default_device(mesh.device_type)

    def stage_layout(self, model: nn.Module) -> tuple[list[list[str]], dict[int, list[int]]]:
        """Module FQNs of every stage and the stage ids of every pp rank, for `model`."""
        fqns, ranks, _ = self._stage_layout(model)
        return fqns, ranks

    def _stage_layout(
        self, model: nn.Module
    ) -> tuple[list[list[str]], dict[int, list[int]], HFStructure | None]:
        cfg, spec = self.config, self.config.schedule_spec
        pp_size = self.mesh.size("pp")
        structure = None
        if cfg.module_fqns_per_model_part is None:
            structure = _hf_structure_or_refuse(model)
        if cfg.pp_schedule_csv is not None:
            ranks = read_csv_stage_layout(cfg.pp_schedule_csv, pp_size=pp_size)
            num_stages = sum(len(s) for s in ranks.values())
        elif cfg.module_fqns_per_model_part is not None:
            num_stages = len(cfg.module_fqns_per_model_part)
            check_stages_per_rank(num_stages=num_stages, pp_size=pp_size, multi_stage=spec.multi_stage)
        else:
            num_stages = num_stages_for(
                num_layers=structure.num_layers,
                pp_size=pp_size,
                multi_stage=spec.multi_stage,
                layers_per_stage=cfg.layers_per_stage,
                round_to_pp_multiple=cfg.round_virtual_stages_to_pp_multiple,
            )
        if cfg.pp_schedule_csv is None:
            ranks = {
                r: stage_ids_this_rank(
                    pp_rank=r, pp_size=pp_size, num_stages=num_stages, v_shape=spec.v_shape
                )
                for r in range(pp_size)
            }
        if cfg.pp_schedule_csv is None:  # a CSV schedule runs whatever micro-batches its rows name
            check_microbatch_count(
                spec=spec,
                pp_batch_size=cfg.pp_batch_size,
                pp_microbatch_size=cfg.pp_microbatch_size,
                num_stages=num_stages,
                pp_size=pp_size,
            )
        if cfg.module_fqns_per_model_part is not None:
            fqns = [list(p) for p in cfg.module_fqns_per_model_part]
            if len(fqns) != num_stages:
                raise ValueError(
                    f"module_fqns_per_model_part has {len(fqns)} parts but pp_schedule_csv lays out {num_stages} stages"
                )
        else:
            fqns = hf_module_fqns_per_stage(model, num_stages=num_stages, structure=structure)
        return fqns, ranks, structure

    def build(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn | None = None,
        parallelize_fn: ParallelizeFn | None = None,
        boundary_layouts: BoundaryLayouts = None,
    ) -> PipelineModel:
        """Cut `model` into this rank's stages and make the schedule.

        The stages share (do not copy) `model`'s modules: treat `model` as consumed. `loss_fn(output,
        labels)` runs per micro-batch on the last stage; the step's loss is the sum over
        micro-batches, so with ``scale_grads_in_schedule=False`` a `loss_fn` that divides by the
        global label-token count gives exactly the gradients of the whole batch.
        ``parallelize_fn(stage_module, *, stage_index, num_stages)`` returns the module to use (or
        None when it changed the module in place).

        ``boundary_layouts`` declares the DTensors among what a stage sends (one `BoundaryLayout`:
        the hidden states; a sequence: one per output position, None for plain tensors), such as the
        sequence-parallel residual stream: they cross as local shards and the next stage rebuilds
        them (see `dtensor_boundary`). A stage sending an undeclared DTensor is a ValueError.
        """
        layouts = normalize_layouts(boundary_layouts)
        cfg = self.config
        fqns_per_stage, ranks, structure = self._stage_layout(model)
        check_adjacent_stages_on_one_rank(
            ranks,
            backend=dist.get_backend(self.mesh.get_mesh("pp").get_group()),
            torch_version=torch.__version__,
        )
        # HF or generic: found by parameter identity, with the name each holding stage knows them by
        tied_places = tied_parameter_places(model, fqns_per_stage)
        tied = {name: sorted(by_stage) for name, by_stage in tied_places.items()}
        check_parameter_coverage(model, fqns_per_stage, shared_ok=tied)
        renamed = renamed_tied_modules(tied_places, fqns_per_stage)
        pp_mesh = self.mesh.get_mesh("pp")
        pp_rank = pp_mesh.get_local_rank()
        num_stages = len(fqns_per_stage)
        shared = modules_in_several_stages(fqns_per_stage)

        parts: list[nn.Module] = []
        stages: list[GuardedStage] = []
        errors = StepErrors()  # a stage error in `step` is recorded here and raised on every pp rank
        needs_token_ids = False
        # Taken before any stage of this rank is parallelized (wrapped modules cannot be copied).
        stand_ins = meta_stand_ins(model, structure=structure) if structure is not None else None
        for stage_index in ranks[pp_rank]:
            part = split_module(
                model, fqns=fqns_per_stage[stage_index], shared_fqns=shared | renamed.get(stage_index, set())
            )
            if structure is not None:
                part = make_causal_lm_stage(
                    part,
                    model=model,
                    structure=structure,
                    stage_index=stage_index,
                    num_stages=num_stages,
                    stand_ins=stand_ins,
                )
                needs_token_ids |= part.needs_token_ids
            if isinstance(cfg.dtype, torch.dtype):  # parsed in __post_init__: a dtype or None
                part = part.to(dtype=cfg.dtype)
            if parallelize_fn is not None:
                returned = parallelize_fn(part, stage_index=stage_index, num_stages=num_stages)
                part = part if returned is None else returned
            # A stage that runs the model's forward from the token ids (`LayerListStage`) needs them.
            needs_token_ids |= bool(getattr(unwrap(part), "needs_token_ids", False))
            _check_fsdp_root(part, stage_index)
            attach_boundary_layouts(part, layouts=layouts, stage_index=stage_index, num_stages=num_stages)
            parts.append(part)
            stage_cls = PipelineStageWithDDP if isinstance(part, DistributedDataParallel) else GuardedStage
            stages.append(
                stage_cls(
                    part, stage_index, num_stages, self.device, group=pp_mesh.get_group(), errors=errors
                )
            )
        schedule_loss = (
            guard_loss(loss_fn, errors=errors, last_stage=num_stages - 1) if loss_fn is not None else None
        )
        try:
            schedule = _make_schedule(cfg, stages, schedule_loss)
        except ValueError as e:  # a rule of a newer torch that `check_microbatch_count` does not know
            raise ValueError(
                f"{e} (pp_batch_size={cfg.pp_batch_size}, pp_microbatch_size={cfg.pp_microbatch_size}: "
                f"{cfg.n_microbatches} micro-batches; {num_stages} pipeline stages)"
            ) from e
        check_ddp_schedule(
            schedule,
            parts=parts,
            stage_ids=list(ranks[pp_rank]),
            name=cfg.pp_schedule_csv or cfg.schedule_spec.name,
        )
        # The first collective of the build: every local refusal above comes before it.
        tied_parameters = TiedParameters.build(
            mesh=self.mesh,
            holders=tied,
            held_as=tied_places,
            stage_ids_per_rank=ranks,
            model_parts=parts,
            part_stage_ids=list(ranks[pp_rank]),
            hf_model=is_transformers_model(model),
        )
        return PipelineModel(
            config=cfg,
            stages=stages,
            model_parts=parts,
            schedule=schedule,
            loss_fn=loss_fn,
            fqns_per_stage=fqns_per_stage,
            stage_ids_per_rank=ranks,
            pp_group=pp_mesh.get_group(),
            device=self.device,
            tied_parameters=tied_parameters,
            needs_token_ids=needs_token_ids,
            step_errors=errors,
        )


def _make_schedule(cfg: PipelineConfig, stages: list[GuardedStage], loss_fn: LossFn | None) -> Any:
    """The torch schedule over this rank's stages (a CSV schedule runs torch's schedule runtime)."""
    if cfg.pp_schedule_csv is not None:
        return torch_internals.csv_schedule(
            list(stages),
            n_microbatches=cfg.n_microbatches,
            loss_fn=loss_fn,
            scale_grads=cfg.scale_grads_in_schedule,
            path=cfg.pp_schedule_csv,
        )
    spec = cfg.schedule_spec
    return spec.cls(
        stages if spec.multi_stage else stages[0],
        n_microbatches=cfg.n_microbatches,
        loss_fn=loss_fn,
        scale_grads=cfg.scale_grads_in_schedule,
    )


def _hf_structure_or_refuse(model: nn.Module) -> HFStructure:
    """The stage structure of a transformers causal LM; any other model must name its stages."""
    cls = type(model).__name__
    if not is_transformers_model(model):
        raise ValueError(
            f"{cls} is not a Hugging Face transformers model, so its stages cannot be derived: set "
            "module_fqns_per_model_part (one list of module FQNs per stage, e.g. "
            "[['tok_embeddings', 'layers.0'], ['layers.1', 'norm', 'output']])"
        )
    try:
        return validate_hf_model_for_pipeline_support(model)
    except ValueError as e:
        raise type(e)(
            f"{e}. To split it anyway, set module_fqns_per_model_part (one list of module FQNs per stage)"
        ) from None


def _default_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _check_fsdp_root(part: nn.Module, stage_index: int) -> None:
    """Gradient sync is deferred to the last micro-batch only when the stage root is an FSDPModule."""
    if not isinstance(part, FSDPModule) and any(isinstance(m, FSDPModule) for m in part.modules()):
        raise ValueError(
            f"parallelize_fn sharded modules inside stage {stage_index} with fully_shard but not the stage "
            "itself; also call fully_shard on the stage module so gradient reduction waits for the last "
            "micro-batch"
        )


_STEP_TAKES_RETURN_OUTPUTS = torch_internals.schedule_step_takes_return_outputs()


class PipelineModel:
    """This rank's share of a pipeline: stage modules, torch stages, the schedule, step/eval.

    `step` and `eval` take the whole local batch (``pp_batch_size`` rows); pass the same tensors on
    every pp rank (each rank uses what its stages need: inputs on the first stage, and on every
    stage where the model's layers read values computed from the token ids before the layers;
    labels on the last; position ids everywhere).
    """

    def __init__(
        self,
        *,
        config: PipelineConfig,
        stages: list[GuardedStage],
        model_parts: list[nn.Module],
        schedule: Any,
        loss_fn: LossFn | None,
        fqns_per_stage: list[list[str]],
        stage_ids_per_rank: dict[int, list[int]],
        pp_group: dist.ProcessGroup,
        device: torch.device,
        tied_parameters: TiedParameters | None = None,
        needs_token_ids: bool = False,
        step_errors: StepErrors | None = None,
    ) -> None:
        self.config = config
        self.stages = stages
        self.model_parts = model_parts
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.fqns_per_stage = fqns_per_stage
        self.stage_ids_per_rank = stage_ids_per_rank
        self._pp_group: dist.ProcessGroup | None = pp_group
        self.device = device
        self.tied_parameters = tied_parameters or TiedParameters.none()
        #: a stage of this rank runs the model from the token ids (`CausalLMStage.needs_token_ids`)
        self.needs_token_ids = needs_token_ids
        self._seq_len: int | None = config.pp_seq_len
        self._tied_synced = False  # the tied copies' gradients were summed by the last `step`
        self._step_errors = step_errors or StepErrors()
        self._checked_forward = False  # the first `step` runs one forward-only micro-batch first
        # A script keeps `pipe` until its end: destroy_distributed() must be able to drop our groups.
        release_groups_at_teardown(self)

    @property
    def pp_group(self) -> dist.ProcessGroup:
        if self._pp_group is None:
            raise RuntimeError("this pipeline's process groups were released by destroy_distributed()")
        return self._pp_group

    def release_process_groups(self) -> None:
        """Drop this pipeline's references to process groups (its pp group, the torch stages' group,
        the tied weights' groups, a DDP stage's group), so `destroy_distributed` can free them and join their gloo
        threads; the pipeline is unusable afterwards."""
        self._pp_group = None
        for stage in self.stages:
            stage.group = None
        for part in self.model_parts:  # DDP stages from parallelize_fn: their dp group
            release_ddp_process_groups(part)
        self.tied_parameters.release_process_groups()

    # ---- layout --------------------------------------------------------------------------
    @property
    def stage_ids(self) -> list[int]:
        return [s.stage_index for s in self.stages]

    @property
    def num_stages(self) -> int:
        return len(self.fqns_per_stage)

    @property
    def has_first_stage(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages)

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self.model_parts:
            yield from part.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """Parameters of this rank's stages under their FQNs in the full model (also through the
        wrappers `parallelize_fn` put around a stage: DDP's ``module.``, torch.compile's ``_orig_mod.``);
        a tied weight's copy under the name one process gives it (``emb.weight``, also where the
        stage holds it as ``head.weight``)."""
        renamed = self.tied_parameters.one_process_names()
        for part in self.model_parts:
            for name, param in named_parameters_in_model(part):
                yield renamed.get(id(param), name), param

    def sync_tied_gradients(self) -> None:
        """Sum the gradients of tied weights over the stages holding them, so every copy steps alike.

        `step` does this itself (also across several `step` calls that accumulate gradients), so
        once a `step` has run this changes nothing (kept for code written against the earlier API);
        before any `step` (a backward of your own through the stage modules) it sums them.
        """
        if self._tied_synced:
            return
        self.tied_parameters.sync_gradients()
        self._tied_synced = True

    def norm_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters for a global gradient norm: each tied weight counted on one stage."""
        duplicates = self.tied_parameters.duplicate_ids()
        return [p for p in self.parameters() if id(p) not in duplicates]

    def train(self, mode: bool = True) -> PipelineModel:
        for part in self.model_parts:
            part.train(mode)
        return self

    # ---- running -------------------------------------------------------------------------
    def step(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **stage_kwargs: Any,
    ) -> torch.Tensor:
        """Forward and backward of one local batch through every micro-batch.

        Returns the sum of the micro-batch losses on a rank holding the last stage and a zero on
        the others (`reduce_loss` makes it the loss on every pp rank). Gradients accumulate into
        the stage parameters; the optimizer step is the caller's.

        A stage forward, `loss_fn` or backward that raises on one rank makes every pp rank raise
        the same `PipelineStageError` (see `step_guard`) with the step's gradients dropped; the next
        `step` runs normally. The first `step` checks one micro-batch forward-only beforehand.
        """
        if self.loss_fn is None:
            raise ValueError("step() needs a loss_fn: pass loss_fn= to AutoPipeline.build")

        def prepare() -> tuple[tuple, dict[str, Any], torch.Tensor | None]:
            if labels is None and self.has_last_stage:
                raise ValueError("labels is required on the rank that holds the last pipeline stage")
            return self._prepare(input_ids, labels, position_ids, stage_kwargs)

        args, kwargs, target = self._agreed(prepare)
        if not self._checked_forward:
            self._check_forward(args, kwargs, target)
        losses: list[torch.Tensor] = []
        extra = {"return_outputs": False} if _STEP_TAKES_RETURN_OUTPUTS else {}
        self.tied_parameters.begin_accumulation()
        self._step_errors.reset()
        self.schedule.step(*args, target=target, losses=losses, **extra, **kwargs)
        raise_if_any_failed(
            self._step_errors, group=self.pp_group, device=self.device, on_failure=self._drop_gradients
        )
        self.tied_parameters.sync_gradients()
        self._tied_synced = True
        return self._sum_losses(losses)

    def _check_forward(self, args: tuple, kwargs: dict[str, Any], target: torch.Tensor | None) -> None:
        """One micro-batch forward-only (and its loss), with the RNG state restored: a stage that
        fails outright fails on every rank here, and each stage learns its output shapes."""
        specs = {st.stage_index: st for st in self.stages}

        def record(stage_index: int, output: Any) -> None:
            specs[stage_index].output_spec = OutputSpec.of(output) or specs[stage_index].output_spec

        devices = [self.device] if self.device.type not in ("cpu", "meta") else []
        with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=self.device.type):
            self._forward_only(args, kwargs, target, use_loss=True, microbatches=1, on_output=record)
        self._checked_forward = True

    def _drop_gradients(self) -> None:
        for p in self.parameters():
            p.grad = None
        self._tied_synced = True

    @torch.no_grad()
    def eval(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **stage_kwargs: Any,
    ) -> torch.Tensor | None:
        """Forward only. With `labels` (and a loss_fn): the summed loss as `step` returns it;
        without: the last stage's output (logits) on its rank, None elsewhere.

        Runs on every schedule alike (see `forward_only`); a stage that raises makes every pp rank
        raise the same `PipelineStageError` instead of leaving its peers waiting.
        """
        use_loss = labels is not None and self.loss_fn is not None
        args, kwargs, target = self._agreed(
            lambda: self._prepare(input_ids, labels if use_loss else None, position_ids, stage_kwargs)
        )
        outs = self._forward_only(args, kwargs, target, use_loss=use_loss)
        if use_loss:
            return self._sum_losses(outs)
        return _merge_outputs(outs) if self.has_last_stage else None

    def _forward_only(
        self,
        args: tuple,
        kwargs: dict[str, Any],
        target: torch.Tensor | None,
        *,
        use_loss: bool,
        microbatches: int | None = None,
        on_output: Callable[[int, Any], None] | None = None,
    ) -> list[Any]:
        """`run_forward` over the first `microbatches` micro-batches (all by default)."""
        n = self.config.n_microbatches
        arg_mbs, kwarg_mbs = split_args_kwargs_into_chunks(args, kwargs, n)
        last_fn: Callable[[int, Any], Any] | None = None
        if use_loss and self.has_last_stage and self.loss_fn is not None:
            target_chunks, _ = split_args_kwargs_into_chunks((target,), None, n)
            target_mbs = [chunk[0] for chunk in target_chunks]
            loss_fn = self.loss_fn
            last_fn = lambda mb, out: loss_fn(out, target_mbs[mb])  # noqa: E731
        k = n if microbatches is None else microbatches
        return run_forward(
            parts={st.stage_index: part for st, part in zip(self.stages, self.model_parts)},
            owner_of_stage={s: r for r, ids in self.stage_ids_per_rank.items() for s in ids},
            num_stages=self.num_stages,
            pp_group=self.pp_group,
            device=self.device,
            arg_mbs=arg_mbs[:k],
            kwarg_mbs=kwarg_mbs[:k],
            last_stage_fn=last_fn,
            on_output=on_output,
        )

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """All-reduce (sum) a `step` result over the pp group: the loss on every pp rank."""
        loss = loss.clone()
        dist.all_reduce(loss, group=self.pp_group)
        return loss

    # ---- helpers -------------------------------------------------------------------------
    def _agreed(self, prepare: Callable[[], Any]) -> Any:
        """`prepare()`, with its ValueError raised on every pp rank alike (a check that fails on one
        rank only would leave the others waiting in the schedule's first receive)."""
        error: str | None = None
        try:
            result = prepare()
        except ValueError as e:
            error, result = str(e), None
        flag = torch.tensor([0 if error is None else 1], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.pp_group)
        if int(flag.item()):
            gathered: list[Any] = [None] * dist.get_world_size(self.pp_group)
            dist.all_gather_object(gathered, error, group=self.pp_group)
            rank, message = next((r, m) for r, m in enumerate(gathered) if m is not None)
            raise ValueError(message if error is not None else f"pp rank {rank}: {message}")
        return result

    def _sum_losses(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if self.has_last_stage and losses:
            return torch.stack([loss.detach().float() for loss in losses]).sum()
        return torch.zeros((), device=self.device)

    def _prepare(
        self,
        input_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        stage_kwargs: dict[str, Any],
    ) -> tuple[tuple, dict[str, Any], torch.Tensor | None]:
        cfg = self.config
        if self.has_first_stage and input_ids is None:
            raise ValueError("input_ids (the first stage's input) is required on the rank that holds stage 0")
        if self.needs_token_ids and input_ids is None:
            raise ValueError(
                "input_ids is required on this rank too: its pipeline stages run the model from the token ids "
                "(the model's layers read values computed from them before the layers)"
            )
        present = [t for t in (input_ids, labels, position_ids) if t is not None]
        if not present:
            return (), dict(stage_kwargs), None
        batch = present[0].shape[0]
        if batch != cfg.pp_batch_size:
            raise ValueError(
                f"the batch has {batch} rows but pp_batch_size={cfg.pp_batch_size} "
                f"(pp_microbatch_size={cfg.pp_microbatch_size})"
            )
        token_lens = [t.shape[1] for t in (input_ids, labels) if t is not None and _is_token_tensor(t)]
        if token_lens:
            seq = token_lens[0]
            if self._seq_len is None:
                self._seq_len = seq  # stages exchange fixed-shape buffers: every step must match
            if seq > self._seq_len or (seq < self._seq_len and cfg.pp_seq_len is None):
                raise ValueError(
                    f"sequence length {seq} differs from the pipeline's {self._seq_len}; stages exchange "
                    "fixed-shape activations, so set pp_seq_len to the longest length (shorter batches are padded)"
                )
            pad = self._seq_len - seq
            if pad:
                input_ids = _pad(input_ids, pad, 0)
                labels = _pad(labels, pad, LABEL_PAD)
                if position_ids is not None:
                    step = torch.arange(1, pad + 1, device=position_ids.device, dtype=position_ids.dtype)
                    position_ids = torch.cat([position_ids, position_ids[:, -1:] + step], dim=1)
        kwargs = dict(stage_kwargs)
        if self.needs_token_ids:
            kwargs["token_ids"] = input_ids
        if position_ids is not None:
            kwargs["position_ids"] = (
                position_ids.expand(batch, -1) if position_ids.shape[0] == 1 else position_ids
            )
        args = (input_ids,) if self.has_first_stage else ()
        target = labels if self.has_last_stage else None
        return args, kwargs, target


def _merge_outputs(outs: list[Any]) -> Any:
    """The last stage's per-micro-batch outputs, concatenated along the batch as one call would give."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs, dim=0)
    if isinstance(first, tuple):
        return tuple(
            torch.cat([o[i] for o in outs], dim=0) if isinstance(first[i], torch.Tensor) else first[i]
            for i in range(len(first))
        )
    return outs


def _is_token_tensor(t: torch.Tensor) -> bool:
    return t.dim() == 2 and not t.is_floating_point() and not t.is_complex()


def _pad(t: torch.Tensor | None, pad: int, value: int) -> torch.Tensor | None:
    if t is None:
        return None
    filler = torch.full((t.shape[0], pad, *t.shape[2:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, filler], dim=1)
