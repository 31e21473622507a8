"""Fault injection for the end-to-end fault tests, reached from a test YAML's ``optimizer._target_``.

`FaultyAdamW` is AdamW plus keys that break the run at a given (absolute, resume-proof) step on
one rank: kill it with SIGKILL (first launch only), send it SIGTERM, hang it, or turn a weight
into NaN. ``slow_save_s`` makes every DCP shard write of the first launch sleep first, so a kill
lands while an async save is still writing. No environment variable or global switch: the test's
config says what happens.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist


class FaultyAdamW(torch.optim.AdamW):
    """AdamW whose `step` injects one fault after the real update of step `at_step`."""

    def __init__(
        self,
        params,
        *,
        fault: str | None = None,
        at_step: int = 0,
        on_rank: int = 0,
        slow_save_s: float = 0.0,
        **kwargs,
    ):
        if fault not in (None, "sigkill", "sigterm", "hang", "nan"):
            raise ValueError(f"optimizer.fault must be sigkill, sigterm, hang or nan, got {fault!r}")
        super().__init__(params, **kwargs)
        self.fault, self.at_step, self.on_rank = fault, at_step, on_rank
        if slow_save_s and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            _slow_down_checkpoint_writes(slow_save_s)

    def _steps_done(self) -> int:
        for group in self.param_groups:
            for p in group["params"]:
                if "step" in self.state.get(p, {}):
                    return int(self.state[p]["step"])
        return 0

    @torch.no_grad()
    def step(self, closure=None):
        out = super().step(closure)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.fault is None or rank != self.on_rank or self._steps_done() != self.at_step:
            return out
        if self.fault == "sigkill":
            # torchrun counts restarts; only the first launch dies, the restarted one runs through.
            if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.fault == "hang":
            time.sleep(600)
        elif self.fault == "nan":
            p = self.param_groups[0]["params"][0]
            (p.to_local() if hasattr(p, "to_local") else p).fill_(float("nan"))
        return out


def _slow_down_checkpoint_writes(seconds: float) -> None:
    """Every DCP shard write of this process first sleeps `seconds` (in the async save's thread)."""
    from torch.distributed.checkpoint import FileSystemWriter

    global _writes_slowed
    if _writes_slowed:
        return
    _writes_slowed = True
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(seconds)
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


_writes_slowed = False
