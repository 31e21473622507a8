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

``checkpoint.is_async: true`` writes the DCP shards with ``dcp.async_save``: the state is copied
into host memory (pinned where a CUDA device allows it, ordinary memory otherwise) while training
waits, and a background thread writes the files over a checkpoint-only gloo group. At most one save
is in flight: the next save, the run's last one and a pre-emption save wait for it. Only once every
rank's write has completed are the checksums, ``checkpoint.json``, the rename and ``LATEST`` written
(`wait`, collective; `maybe_save` does it at the first step boundary where all ranks are done), so
a crash mid-write leaves the previous checkpoint as the newest complete one. The adapter and the
consolidated export are written by the training thread from the live weights at save time.
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
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from automodel.mesh import MeshContext, parallel_axes
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
from automodel.recipes.peft import LoRAInfo, save_adapter

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


#: torch < 2.13's `DefaultStager` empties its copier table after each staging (its `_stage` calls
#: `close()` on the inner stager), so a second `async_save` through it fails with
#: ``KeyError: <class 'type'>``; there a save gets a stager of its own. Newer releases keep the table
#: and the stager (with its cached host buffers) serves every save.
STAGER_IS_SINGLE_USE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def _new_stager(*, pinned: bool) -> DefaultStager:
    """The host-memory stager of ``is_async`` saves, staged before `save` returns."""
    return DefaultStager(
        StagingOptions(
            use_pinned_memory=pinned,
            use_shared_memory=False,
            use_async_staging=False,  # staged before `save` returns: training may then change it
            use_non_blocking_copy=pinned,
        )
    )


@dataclass
class _InFlight:
    """An async save whose files are still being written: published by `Checkpointer.wait`."""

    future: Future | None  # None: a synchronous save (already written)
    tmp: Path
    final: Path
    step: int
    started: float
    files: list[str] = field(default_factory=list)
    adapter_files: list[str] = field(default_factory=list)


def _written(pending: _InFlight) -> None:
    """Block until this rank's async write of `pending` has completed; a failure names the save."""
    if pending.future is None:
        return
    try:
        pending.future.result()
    # CheckpointException (a BaseException) carries every rank's failure.
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised with the checkpoint named
        raise CheckpointError(
            f"async save of step {pending.step} into {pending.tmp} failed ({type(err).__name__}: {err}); "
            f"it is not marked complete, {paths.LATEST_FILE} still names the previous checkpoint"
        ) from err


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
        lora: LoRAInfo | None = None,
        base_model_name_or_path: str | None = None,
    ):
        self.config = config
        self.mesh = mesh
        self.lora = lora  # a LoRA run: its adapters and section
        self.base_model_name_or_path = base_model_name_or_path
        self.root = paths.checkpoint_root(checkpoint_dir=config.checkpoint_dir, output_dir=output_dir)
        self.last_saved_step: int | None = None
        self.restored_from: Path | None = None  # set by `restore`: the checkpoint this run resumed
        self._sigterm = False
        self._preemption_seen = False
        self._preemption_announced = False
        self._previous_handler: Any = None
        self._install_sigterm_handler()
        #: seconds the caller was blocked in `save` / `maybe_save` / `wait` (the training stall)
        self.stall_s = 0.0
        #: the part of `stall_s` spent publishing (checksums, checkpoint.json, rename, LATEST)
        self.publish_s = 0.0
        self._in_flight: _InFlight | None = None
        self._stager: DefaultStager | None = None
        self._save_group: Any = None
        #: is_async only: "pinned" or "unpinned" host memory for the staged copy
        self.staging: str | None = None
        if config.enabled and config.is_async:
            pinned = torch.cuda.is_available()  # pinning needs a CUDA device (driver) to register pages
            self._stager = _new_stager(pinned=pinned)
            self.staging = "pinned" if pinned else "unpinned"
            if dist.is_initialized() and dist.get_backend() != "fake":
                # The background write's collectives get their own group, so they never interleave
                # with the training thread's on the default one.
                self._save_group = dist.new_group(backend="gloo")

    @property
    def startup_line(self) -> str | None:
        """What checkpoint.is_async does on this machine (None when it is off)."""
        if self.staging is None:
            return None
        memory = (
            "pinned host memory"
            if self.staging == "pinned"
            else "ordinary (non-pinned) host memory (no CUDA device here: pinning is impossible)"
        )
        return (
            f"checkpoint.is_async: true: each save copies the state into {memory} while training waits, "
            "then writes it in the background (dcp.async_save); LATEST moves once the write completes"
        )

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
        """Put back the SIGTERM handler that was there before.

        An async save still in flight here (the run failed before `wait`) is not published: no
        collective runs on this path, its ``.tmp-`` directory is removed by the next resume.
        """
        if self._in_flight is not None:
            log.warning(
                "async save of step %d was not completed; it is not marked complete (%s stays unpublished)",
                self._in_flight.step,
                self._in_flight.tmp,
            )
            self._in_flight = None
        elif self._stager is not None:
            self._stager.close()  # its staging buffers; not while a write may still read them
            self._stager = None
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    # ---- save ----------------------------------------------------------------------------
    def maybe_save(self, state: TrainingState, *, every_steps: int | None) -> Path | None:
        """`save` when checkpointing is on and ``state.step`` is a positive multiple of `every_steps`."""
        if self._in_flight is not None:
            self._publish_if_written()
        if not self.config.enabled or not every_steps or state.step <= 0 or state.step % every_steps:
            return None
        return self.save(state)

    def _publish_if_written(self) -> None:
        """Publish the async save when every rank's write has completed (a MIN all-reduce). Collective."""
        assert self._in_flight is not None
        t0 = time.perf_counter()
        try:
            done = self._in_flight.future is None or self._in_flight.future.done()
            if dist.is_initialized() and dist.get_backend() != "fake":
                device = "cuda" if dist.get_backend() == "nccl" else "cpu"
                t = torch.tensor([int(done)], device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MIN)
                done = bool(t.item())
            if done:
                self._complete()
        finally:
            self.stall_s += time.perf_counter() - t0

    def wait(self) -> Path | None:
        """Block until the async save in flight (if any) has completed, then publish it. Collective.

        Returns the published checkpoint, None when none was in flight. A failed write raises
        `CheckpointError` and is never marked complete: ``LATEST`` keeps naming the previous one.
        """
        t0 = time.perf_counter()
        try:
            return self._complete()
        finally:
            self.stall_s += time.perf_counter() - t0

    def _complete(self) -> Path | None:
        pending, self._in_flight = self._in_flight, None
        if pending is None:
            return None
        _written(pending)
        return self._publish(pending)

    def save(self, state: TrainingState, *, last: bool = False) -> Path | None:
        """Write ``step_<state.step>`` atomically and point ``LATEST`` at it; None when disabled.

        Saving the step already saved by this checkpointer is a no-op returning its path. `last`:
        the run's final checkpoint (``save_consolidated: final`` writes consolidated/ only there).
        With ``is_async`` the write goes on in the background and ``LATEST`` moves later (`wait`),
        except for the last save and a pre-emption save, which return once published.
        """
        if not self.config.enabled:
            return None
        t0 = time.perf_counter()
        try:
            return self._save(state, last=last)
        finally:
            self.stall_s += time.perf_counter() - t0

    def _save(self, state: TrainingState, *, last: bool) -> Path:
        self._complete()  # at most one save in flight: the previous one completes (and is published) first
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
        if self._stager is None:
            dcp.save(build_save_state(state), checkpoint_id=str(tmp))
            future: Future | None = None
        else:
            if STAGER_IS_SINGLE_USE:
                self._stager.close()
                self._stager = _new_stager(pinned=self.staging == "pinned")
            response = dcp.async_save(
                build_save_state(state),
                checkpoint_id=str(tmp),
                process_group=self._save_group,
                async_stager=self._stager,
            )
            assert isinstance(response, Future)  # the stager stages synchronously: a plain Future
            future = response
        pending = _InFlight(future=future, tmp=tmp, final=final, step=state.step, started=started)
        in_flight = future is not None and not (last or self._preemption_seen)
        if future is not None and not in_flight:
            _written(pending)  # the run ends here: the write completes before the exports and the publish
        lora_scales = None
        if self.lora is not None:
            pending.adapter_files = save_adapter(
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
            pending.files = save_consolidated(
                model_parts=state.model_parts,
                directory=tmp / paths.CONSOLIDATED_DIR,
                model_save_format=self.config.model_save_format,
                hf_config=state.hf_config,
                tokenizer=state.tokenizer,
                lora_scales=lora_scales,
                strategy=state.strategy,
            )
        if not in_flight:
            return self._publish(pending)
        self._in_flight = pending  # published by `wait`: at a later step boundary, the next save or the end
        return final

    def _publish(self, pending: _InFlight) -> Path:
        """Checksums, ``checkpoint.json``, rename, ``LATEST``, retention: the save is complete. Collective."""
        t0 = time.perf_counter()
        try:
            return self._publish_now(pending)
        finally:
            self.publish_s += time.perf_counter() - t0

    def _publish_now(self, pending: _InFlight) -> Path:
        tmp, final = pending.tmp, pending.final
        _barrier()
        listed = _broadcast_from_0(sorted(paths.file_sizes(tmp)) if _rank() == 0 else None)
        checksums = integrity.gather_checksums(tmp, listed)  # every rank hashes a share
        if _rank() == 0:
            info = {
                "format_version": FORMAT_VERSION,
                "step": pending.step,
                "world_size": _world(),
                "layout": self._layout_summary(),
                "model_save_format": self.config.model_save_format,
                "consolidated_files": [f"{paths.CONSOLIDATED_DIR}/{f}" for f in pending.files],
                "adapter_files": [f"{paths.ADAPTER_DIR}/{f}" for f in pending.adapter_files],
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
            log.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - pending.started)
        _barrier()
        self.last_saved_step = pending.step
        self._announce_preemption(final, pending.step)
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
        return {axis: lay.axis_size(axis) for axis in parallel_axes()}

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
