"""Context-parallel attention runs its backward under the CP context of its forward.

torch's context parallelism dispatches the backward kernels of ring attention only inside its
context, so the loop must call ``backward()`` there. The test wraps the context the loop gets
from `make_cp_batch_and_ctx` (CPU ring backend here), and a gradient hook on every attention
output records whether the context was open when that gradient was computed.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import preload, tiny_config  # noqa: E402

from automodel.testing.ranks import run_on_ranks  # noqa: E402

preload()


def _train_recording_context(raw: dict[str, Any]) -> dict[str, int]:
    import automodel.recipes.parallelisms.cp as cp_module
    from automodel.recipes import load_config
    from automodel.recipes.trainer import Trainer

    seen = {"contexts": 0, "grads_inside": 0, "grads_outside": 0}
    open_contexts = [0]
    make = cp_module.make_cp_batch_and_ctx  # the name the CP batch transform calls

    def recording_make(*args: Any, **kwargs: Any):
        ctx, local = make(*args, **kwargs)

        @contextlib.contextmanager
        def recorded():
            seen["contexts"] += 1
            open_contexts[0] += 1
            try:
                with ctx():
                    yield
            finally:
                open_contexts[0] -= 1

        return recorded, local

    cp_module.make_cp_batch_and_ctx = recording_make
    trainer = Trainer(load_config(raw))
    trainer.build()

    def on_grad(grad):
        seen["grads_inside" if open_contexts[0] else "grads_outside"] += 1
        return grad

    def hook_output(_module, _args, output):
        attn_out = output[0] if isinstance(output, tuple) else output
        if attn_out.requires_grad:
            attn_out.register_hook(on_grad)

    for name, module in trainer.pm.parts[0].named_modules():
        if name.endswith("self_attn"):
            module.register_forward_hook(hook_output)
    trainer.train_step(trainer.loader.next_step())
    return seen


def test_cp_attention_backward_runs_inside_the_cp_context(tmp_path: Path) -> None:
    cfg = tiny_config(str(tmp_path), distributed={"strategy": "fsdp2", "cp_size": 2})
    for rank, seen in enumerate(
        run_on_ranks(_train_recording_context, world_size=2, args=(cfg,), timeout_s=300)
    ):
        # 4 micro-batches (global 8 = local 2 x 4 accumulation steps), 2 attention layers each.
        assert seen["contexts"] == 4, (rank, seen)
        assert seen["grads_inside"] == 8, (rank, seen)
        assert seen["grads_outside"] == 0, (rank, seen)
