"""The one pre-launch validation of a recipe: every check a run makes before it trains.

It runs inside the one resolution of a run (`resolved_run.resolve_run`), shared by `recipes
validate`, `recipes train` (the launcher, once per machine before it starts any rank; the ranks it
starts do not check again), the Python API (`automodel.recipes.train`, in the process that
resolves) and `recipes plan` (each layout it proposes, through `planning.admit`), so a config one of
them refuses is refused by every one with the same message. In order:

1. the optimizer's arguments (`preflight.check_optimizer_kwargs`);
2. on the machine that runs (``this_machine=True``): the data paths, what this machine cannot run
   (`environment.check_environment`), ``checkpoint.restore_from``, the data rows and the pretrained
   weights (`preflight.check_run_files`), the experiment trackers (`trackers.check_trackers`: the
   ``wandb:`` / ``mlflow:`` package installed, their folder or tracking URI writable / reachable).
   `recipes validate` and `recipes plan` plan for machines
   they may not run on: they skip the files and report the environment's refusal instead;
3. the layout: the sizes against the world size, then every rule of `rules.py` on the
   meta-device model, then the meshes built for the world size (a fake process group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn

from automodel.mesh import MeshContext, ResolvedLayout, detect_launch_env, fake_world
from automodel.recipes._dist_setup import resolve_layout
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.data.kinds import check_paths as check_data_paths
from automodel.recipes.environment import check_environment, check_machine
from automodel.recipes.errors import ConfigError
from automodel.recipes.model import build_hf_config, build_meta_model
from automodel.recipes.preflight import check_optimizer_kwargs, check_optimizer_on_model, check_run_files
from automodel.recipes.rules import ModelChecks, check_layout_rules, pipeline_stages
from automodel.recipes.trackers import check_trackers

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class CheckedLaunch:
    """What the checks resolved, for the callers that go on to plan or report."""

    layout: ResolvedLayout
    hf_config: PretrainedConfig
    #: The meta-device model the rules ran on (callers may reuse it, e.g. for parameter counts).
    model: nn.Module
    #: Pipeline stages of the configured schedule (1 without pp).
    stages: int
    #: What this machine cannot run, reported instead of raised (``this_machine=False`` only;
    #: ``cfg.refusals``, which run on no machine, are not among them).
    machine_refusals: tuple[ConfigError, ...] = ()


def launch_world_size() -> int:
    """The world size of this process's job: its process group's, else the launcher's variables."""
    return dist.get_world_size() if dist.is_initialized() else detect_launch_env().world_size


def check_launch(
    cfg: RecipeConfig,
    *,
    world_size: int,
    this_machine: bool,
    hf_config: PretrainedConfig | None = None,
    model: nn.Module | None = None,
    model_checks: ModelChecks | None = None,
    read_files: bool = True,
) -> CheckedLaunch:
    """Every pre-launch check of `cfg` for `world_size` ranks; `ConfigError` (or `DataError`) names
    the key (or the file and line) of the first failure.

    `hf_config` / `model`: the model's config and meta-device model when the caller already built
    them (`recipes plan` checks many layouts of one model); otherwise they are built here.
    `model_checks`: the outcomes of the model-dependent checks on `model` so far (`rules.ModelChecks`),
    filled in here. `read_files=False`: this machine's files (data rows, weights, the checkpoint to
    restore) were read by the `recipes` launcher already; every rank reading them again would
    repeat that I/O once per rank."""
    check_optimizer_kwargs(cfg.optimizer)
    machine_refusals = _check_machine(cfg, read_files=read_files) if this_machine else _machine_refusals(cfg)
    layout = resolve_layout(cfg.distributed, world_size)
    if hf_config is None:
        hf_config = build_hf_config(cfg.model, announce=False)  # the run announces remote code once
    if model is None:
        model = build_meta_model(
            hf_config, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code
        )
    if cfg.peft is None:  # with LoRA only the adapters train, and they are not on this model yet
        check_optimizer_on_model(cfg.optimizer, model)
    check_layout_rules(cfg, layout, hf_config, model=model, memo=model_checks)
    if not dist.is_initialized():  # in a rank, the real meshes are built next from the same sizes
        with fake_world(world_size):
            mesh = MeshContext.build(cfg.distributed.sizes, device_type="cpu")
            assert mesh.layout == layout
    stages = pipeline_stages(cfg, layout, hf_config)
    return CheckedLaunch(
        layout=layout, hf_config=hf_config, model=model, stages=stages, machine_refusals=machine_refusals
    )


def _check_machine(cfg: RecipeConfig, *, read_files: bool) -> tuple[ConfigError, ...]:
    """Refuse what this machine cannot run or read (the run is about to start here)."""
    check_data_paths(cfg.dataset)
    check_data_paths(cfg.validation_dataset)
    check_environment(cfg)
    check_trackers(cfg)
    if read_files:
        check_run_files(cfg)
    return ()


def _machine_refusals(cfg: RecipeConfig) -> tuple[ConfigError, ...]:
    """What `_check_machine`'s environment check would refuse on this machine, as a value (planning
    for another machine: a cluster's paths and GPUs need not exist on this one). The settings that
    run on no machine (``cfg.refusals``) are the caller's to refuse, after its report."""
    try:
        check_machine(cfg)
        check_trackers(cfg)
    except ConfigError as e:
        return (e,)
    return ()
