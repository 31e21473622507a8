"""`Checkpointer`: save, resume and pre-emption for the training loop.

Save: every rank writes its DCP shards (and its share of the consolidated HF export) into
``.tmp-step_<N>``; after a barrier rank 0 writes ``checkpoint.json``, renames the directory to
``step_<N>``, then replaces ``LATEST`` and applies retention. A crash at any point leaves the
previous checkpoint and ``LATEST`` untouched. Restore resolves ``restore_from`` on rank 0 and
broadcasts the choice, so all ranks load the same checkpoint.

A LoRA run (`lora` given) also writes ``adapter/`` (Hugging Face PEFT format, see
`automodel.recipes.peft.export`); its ``consolidated/`` export is written only with
``peft.save_merged: true``, and then holds the adapters merged into the base weights. The DCP
state holds the whole model (frozen base included), so a resume needs nothing else.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from automodel.mesh import PARALLEL_AXES, MeshContext
from automodel.recipes.checkpoint import integrity, paths
from automodel.recipes.checkpoint.consolidated import save_consolidated
from automodel.recipes.checkpoint.paths import CheckpointError
from automodel.recipes.checkpoint.safe_dcp import SafeFileSystemReader, SafeLoadPlanner
from automodel.recipes.checkpoint.state import (
    EXTRA_PREFIX,
    OPTIM_KEY,
    TrainingState,
    apply_loaded_state,
    build_load_state,
    build_save_state,
    has_extra,
    has_legacy_extra,
)
from automodel.recipes.config.checkpoint import CheckpointConfig
from automodel.recipes.peft import save_adapter

log = logging.getLogger(__name__)

# 1: per-rank training state as one pickled blob (refused on load, see `legacy_format_message`);
# 2: the same state as JSON + tensor entries, nothing pickled.
FORMAT_VERSION = 2


def legacy_format_message(path: Path) -> str:
    """Why a format-1 checkpoint is refused, and the command that converts it."""
    return (
        f"checkpoint {path} stores its training state (step, LR schedulers, dataloader, RNG) as a pickle "
        "(checkpoint format 1); unpickling it could run code from the checkpoint, so it is not loaded. "
        "If you trust whoever wrote it, convert it once with "
        f"`python -m automodel.recipes.checkpoint.convert_legacy --trust-pickle {path} <new directory>` "
        "and resume from the new directory"
    )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _broadcast_from_0(obj: Any) -> Any:
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Checkpointer:
    """Saves and restores a `TrainingState` under ``checkpoint_dir``; flags SIGTERM as `preempted`.

    Every public method except `preempted`'s local flag is collective: call it on all ranks.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        output_dir: str | os.PathLike,
        mesh: MeshContext | None = None,
        lora: Any = None,
        base_model_name_or_path: str | None = None,
    ):
        self.config = config
        self.mesh = mesh
        self.lora = lora  # automodel.recipes.peft.LoRAInfo of a LoRA run
        self.base_model_name_or_path = base_model_name_or_path
        self.root = paths.checkpoint_root(checkpoint_dir=config.checkpoint_dir, output_dir=output_dir)
        self.last_saved_step: int | None = None
        self.restored_from: Path | None = None  # set by `restore`: the checkpoint this run resumed
        self._sigterm = False
        self._preemption_seen = False
        self._preemption_announced = False
        self._previous_handler: Any = None
        self._install_sigterm_handler()

    # ---- pre-emption ---------------------------------------------------------------------
    def _install_sigterm_handler(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning("Checkpointer created off the main thread: SIGTERM will not trigger a save")
            return
        self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._sigterm = True

    @property
    def preempted(self) -> bool:
        """True once any rank got SIGTERM. Collective (an all-reduce): every rank asks at the same point."""
        flag = self._sigterm
        if dist.is_initialized() and dist.get_backend() != "fake":
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            t = torch.tensor([int(flag)], device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag = bool(t.item())
        self._preemption_seen = self._preemption_seen or flag
        return flag

    def close(self) -> None:
        """Put back the SIGTERM handler that was there before."""
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    # ---- save ----------------------------------------------------------------------------
    def maybe_save(self, state: TrainingState, *, every_steps: int | None) -> Path | None:
        """`save` when checkpointing is on and ``state.step`` is a positive multiple of `every_steps`."""
        if not self.config.enabled or not every_steps or state.step <= 0 or state.step % every_steps:
            return None
        return self.save(state)

    def save(self, state: TrainingState, *, last: bool = False) -> Path | None:
        """Write ``step_<state.step>`` atomically and point ``LATEST`` at it; None when disabled.

        Saving the step already saved by this checkpointer is a no-op returning its path. `last`:
        the run's final checkpoint (``save_consolidated: final`` writes consolidated/ only there).
        """
        if not self.config.enabled:
            return None
        final = self.root / paths.step_dir_name(state.step)
        if self.last_saved_step == state.step:
            self._announce_preemption(final, state.step)  # SIGTERM on a step that was just saved
            return final
        started = time.perf_counter()
        tmp = self.root / f"{paths.TMP_PREFIX}{final.name}"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        dcp.save(build_save_state(state), checkpoint_id=str(tmp))
        files: list[str] = []
        adapter_files: list[str] = []
        lora_scales = None
        if self.lora is not None:
            adapter_files = save_adapter(
                model_parts=state.model_parts,
                directory=tmp / paths.ADAPTER_DIR,
                info=self.lora,
                base_model_name_or_path=self.base_model_name_or_path,
                strategy=state.strategy,
            )
            lora_scales = dict.fromkeys(self.lora.module_fqns, self.lora.section.scale)
        consolidate = self.config.save_consolidated is True or (
            self.config.save_consolidated == "final" and last
        )
        if consolidate and (self.lora is None or self.lora.section.save_merged):
            (tmp / paths.CONSOLIDATED_DIR).mkdir(exist_ok=True)
            files = save_consolidated(
                model_parts=state.model_parts,
                directory=tmp / paths.CONSOLIDATED_DIR,
                model_save_format=self.config.model_save_format,
                hf_config=state.hf_config,
                tokenizer=state.tokenizer,
                lora_scales=lora_scales,
                strategy=state.strategy,
            )
        _barrier()
        listed = _broadcast_from_0(sorted(paths.file_sizes(tmp)) if _rank() == 0 else None)
        checksums = integrity.gather_checksums(tmp, listed)  # every rank hashes a share
        if _rank() == 0:
            info = {
                "format_version": FORMAT_VERSION,
                "step": state.step,
                "world_size": _world(),
                "layout": self._layout_summary(),
                "model_save_format": self.config.model_save_format,
                "consolidated_files": [f"{paths.CONSOLIDATED_DIR}/{f}" for f in files],
                "adapter_files": [f"{paths.ADAPTER_DIR}/{f}" for f in adapter_files],
                # Sizes of everything written, so a truncated file marks the checkpoint corrupt.
                "files": paths.file_sizes(tmp),
                integrity.CHECKSUMS_KEY: checksums,
                "saved_at": time.time(),
            }
            info_tmp = tmp / f"{paths.INFO_FILE}.tmp"
            with open(info_tmp, "w") as f:
                json.dump(info, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(info_tmp, tmp / paths.INFO_FILE)
            paths.publish(tmp, final)
            paths.write_latest(self.root, final.name)
            if self.config.keep_last_n is not None:
                for removed in paths.apply_retention(self.root, self.config.keep_last_n):
                    log.info("retention (keep_last_n=%d): removed %s", self.config.keep_last_n, removed)
            log.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - started)
        _barrier()
        self.last_saved_step = state.step
        self._announce_preemption(final, state.step)
        return final

    def _announce_preemption(self, final: Path, step: int) -> None:
        """Rank 0's line for a save made because of SIGTERM (also when that step was already saved)."""
        if self._preemption_seen and not self._preemption_announced and _rank() == 0:
            self._preemption_announced = True
            print(
                f"SIGTERM received (pre-emption): saved checkpoint {final} at step {step}; "
                "stopping now. Run the same command again to resume from it.",
                file=sys.stderr,
                flush=True,
            )

    def _layout_summary(self) -> dict[str, int] | None:
        if self.mesh is None:
            return None
        lay = self.mesh.layout
        return {axis: lay.axis_size(axis) for axis in PARALLEL_AXES}

    # ---- restore -------------------------------------------------------------------------
    def resolve_restore_path(self) -> Path | None:
        """Which checkpoint `restore` would load (None: start fresh). Collective."""
        choice: tuple[str | None, str | None] = (None, None)
        if _rank() == 0:
            try:
                path = self._resolve_on_rank0()
                choice = (str(path) if path is not None else None, None)
            except (CheckpointError, ValueError) as err:
                choice = (None, f"{type(err).__name__}: {err}")
        path_str, error = _broadcast_from_0(choice)
        if error is not None:
            raise CheckpointError(error)
        return Path(path_str) if path_str is not None else None

    def _resolve_on_rank0(self) -> Path | None:
        paths.remove_stale(self.root)
        spec = self.config.restore_from
        if spec is None:
            path = paths.newest_complete(self.root)
            if path is None:
                log.info("no complete checkpoint in %s: starting from scratch", self.root)
            return path
        path = paths.resolve_restore_spec(self.root, spec)
        paths.check_complete(path)
        return path

    def restore(self, state: TrainingState, *, restore_rng: bool = True) -> int | None:
        """Load the checkpoint chosen by ``restore_from`` into `state`; return its step, or None.

        None means there was nothing to resume from (``restore_from`` unset and no complete
        checkpoint). Works across layouts: model and optimizer reshard; the per-rank RNG state
        is restored only when the world size is unchanged.
        """
        if not self.config.enabled:
            return None
        path = self.resolve_restore_path()
        if path is None:
            return None
        path = integrity.verified(  # checksums; a corrupt one names its file (or falls back)
            path,
            root=self.root,
            on_corrupt=self.config.on_corrupt,
            explicit=self.config.restore_from is not None,
        )
        # DCP's own reader unpickles .metadata and loads non-tensor entries with weights_only=False:
        # read both through the restricted paths of `safe_dcp` instead.
        reader = SafeFileSystemReader(str(path))
        try:
            metadata = reader.read_metadata()
        except Exception as err:  # noqa: BLE001 - any unreadable metadata is a corrupt checkpoint
            raise CheckpointError(f"checkpoint {path} is corrupt: cannot read DCP metadata ({err})") from err
        saved_keys = set(metadata.state_dict_metadata)
        own_key = f"{EXTRA_PREFIX}{_rank()}"
        info = paths.check_complete(path)
        if has_legacy_extra(metadata, own_key) or has_legacy_extra(metadata, f"{EXTRA_PREFIX}0"):
            raise CheckpointError(legacy_format_message(path))
        same_world = info.get("world_size") == _world() and has_extra(metadata, own_key)
        extra_key = own_key if same_world else f"{EXTRA_PREFIX}0"
        if not has_extra(metadata, extra_key):
            raise CheckpointError(f"checkpoint {path} is corrupt: it has no {extra_key!r} entry")
        if not same_world and _rank() == 0:
            log.info(
                "checkpoint %s was saved by %s ranks, this run has %d: model and optimizer reshard; "
                "step, schedulers and dataloader come from rank 0, RNG states are not restored",
                path,
                info.get("world_size"),
                _world(),
            )
        with_optim = any(k.startswith(f"{OPTIM_KEY}.") for k in saved_keys)
        if state.optimizers and not with_optim:
            raise CheckpointError(f"checkpoint {path} holds no optimizer state but this run has optimizers")
        loaded = build_load_state(state, metadata=metadata, extra_key=extra_key, with_optim=with_optim)
        try:
            dcp.load(loaded, storage_reader=reader, planner=SafeLoadPlanner())
        # CheckpointException (a BaseException) carries every rank's failure, e.g. an entry that
        # the weights-only unpickler refused.
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised with the checkpoint named
            raise CheckpointError(f"could not load checkpoint {path}: {type(err).__name__}: {err}") from err
        apply_loaded_state(state, loaded, extra_key=extra_key, restore_rng=restore_rng and same_world)
        self.last_saved_step = state.step
        self.restored_from = path
        if _rank() == 0:
            log.info("resumed from %s at step %d", path, state.step)
        return state.step
