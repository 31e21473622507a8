"""One resolved run per launch: a recipe config, resolved once, handed to every rank.

`resolve_run` is the one resolution of a `RecipeConfig`, shared by `recipes validate` and
`recipes plan` (machine-neutral: they plan for machines they may not run on), `recipes train`'s
launcher and the Python API `automodel.recipes.train` (for the machine that runs). It applies the
machine's defaults (`_dist_setup.resolve_machine_defaults`), runs every pre-launch check
(`launch_check.check_launch`) and returns a frozen `ResolvedRun`: the config as the ranks run it,
the world size, the layout, the HF config and the pipeline stages.

Who resolves: the `recipes` launcher (once per machine, before it starts any rank; the ranks it
starts read the pickled value from the file named by ``--launcher-resolved``), the single process
of a one-process `recipes train`, and otherwise each process that calls `automodel.recipes.train`
(ranks launched by a plain torchrun or srun: there is no launcher to resolve for them). A rank
handed a `ResolvedRun` checks only rank-local facts (its process group's size, its device).

The meta-device model the checks ran on is kept for the first trainer of this process that asks
(`take_meta_model`), so a process builds it once; it does not travel to other processes.
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.dynamic_module_utils import init_hf_modules

from automodel.mesh import ResolvedLayout, detect_launch_env
from automodel.recipes._dist_setup import resolve_machine_defaults
from automodel.recipes.config.recipe import RecipeConfig
from automodel.recipes.errors import ConfigError
from automodel.recipes.launch_check import check_launch
from automodel.recipes.model import build_hf_config
from automodel.recipes.rules import ModelChecks


class _ModelSlot:
    """Holds this process's meta-device model until one trainer takes it; never pickled (a meta
    model is rebuilt from the HF config in each process that needs one)."""

    def __init__(self, model: nn.Module | None) -> None:
        self.model = model

    def take(self) -> nn.Module | None:
        model, self.model = self.model, None
        return model

    def peek(self) -> nn.Module | None:
        return self.model

    def __getstate__(self) -> dict[str, None]:
        return {"model": None}


@dataclass(frozen=True)
class ResolvedRun:
    """A recipe resolved for `world_size` ranks: what every rank of the run trains from."""

    #: The config the ranks run: the machine's defaults applied when resolved for this machine.
    cfg: RecipeConfig
    world_size: int
    layout: ResolvedLayout
    hf_config: PretrainedConfig
    #: Pipeline stages of the configured schedule (1 without pp).
    stages: int
    #: Resolved for the machine that runs it (its defaults applied, its environment checked).
    for_this_machine: bool
    #: This machine's run files (data rows, weights, the checkpoint to restore) were read.
    files_read: bool
    #: What this machine cannot run, reported instead of raised (machine-neutral resolution only).
    machine_refusals: tuple[ConfigError, ...] = ()
    _model: _ModelSlot = field(default_factory=lambda: _ModelSlot(None), compare=False, repr=False)

    @property
    def output_dir(self) -> str:
        return self.cfg.output_dir

    def take_meta_model(self) -> nn.Module | None:
        """The meta-device model the checks ran on, once (the trainer mutates it); None when it was
        taken already or this value came from another process."""
        return self._model.take()

    @property
    def meta_model(self) -> nn.Module | None:
        """The meta-device model the checks ran on, if not taken (read-only use: counts, plans)."""
        return self._model.peek()

    def save(self, path: Path) -> None:
        """Pickle this run for the ranks the launcher starts (the meta model stays here)."""
        path.write_bytes(pickle.dumps(self))

    @staticmethod
    def load(path: Path) -> ResolvedRun:
        """A run `save` wrote on this machine (the launcher's private directory: trusted)."""
        init_hf_modules()  # a remote-code config's module is importable once its cache is on sys.path
        run = pickle.loads(path.read_bytes())
        assert isinstance(run, ResolvedRun), type(run)
        return run


def resolve_run(
    cfg: RecipeConfig,
    *,
    world_size: int,
    this_machine: bool,
    read_files: bool = True,
    hf_config: PretrainedConfig | None = None,
    model: nn.Module | None = None,
    model_checks: ModelChecks | None = None,
) -> ResolvedRun:
    """Resolve `cfg` for `world_size` ranks; `ConfigError` (or `DataError`) names the first failure.

    `this_machine`: the run starts here (`recipes train`, the Python API): the machine's defaults
    are applied and its environment and files are checked (the files only with `read_files`).
    Otherwise (`recipes validate`, `recipes plan`) the config stays machine-neutral and what this
    machine cannot run is reported in `ResolvedRun.machine_refusals`. `hf_config` / `model`: built
    already by the caller (`recipes plan` checks many layouts of one model)."""
    if this_machine:
        distributed = resolve_machine_defaults(
            cfg.distributed,
            cuda=torch.cuda.is_available(),
            world_size=world_size,
            param_dtype=cfg.model.dtype,
        )
        cfg = dataclasses.replace(cfg, distributed=distributed)
    if hf_config is None:  # the run says once (its rank 0, or its launcher) that remote code may run
        hf_config = build_hf_config(cfg.model, announce=this_machine and detect_launch_env().rank == 0)
    checked = check_launch(
        cfg,
        world_size=world_size,
        this_machine=this_machine,
        hf_config=hf_config,
        model=model,
        model_checks=model_checks,
        read_files=read_files,
    )
    return ResolvedRun(
        cfg=cfg,
        world_size=world_size,
        layout=checked.layout,
        hf_config=checked.hf_config,
        stages=checked.stages,
        for_this_machine=this_machine,
        files_read=this_machine and read_files,
        machine_refusals=checked.machine_refusals,
        _model=_ModelSlot(checked.model),
    )


def check_rank(run: ResolvedRun, *, world_size: int) -> None:
    """The rank-local facts a rank handed `run` checks: it was resolved for this machine and for
    this process group's size (the launcher ran every other check)."""
    if not run.for_this_machine:
        raise ConfigError(
            "world_size", run.world_size, "the run was resolved for planning (validate/plan), not to train"
        )
    if world_size != run.world_size:
        raise ConfigError(
            "world_size",
            world_size,
            f"this process group has {world_size} ranks; the run was resolved for {run.world_size}",
        )
