"""Run a model of one's own as pipeline stages through its own, unchanged ``forward``.

A forward written for one process (nanoGPT's ``GPT.forward(idx)``: positions from ``idx``, the
embeddings, a loop over ``self.transformer.h``, ``ln_f``, the head) cannot run a stage as it is:
a later stage receives hidden states, not token ids, and does not hold the embeddings or the
final norm. `LayerListForward`, passed as ``parallelize_fn``, wraps each stage so that the
model's forward runs the stage's slice of it, given three facts about the model: the FQN of its
layer list (``layers``), the modules its forward runs before the layers (``before``), and those
it runs after them (``after``, in order, or a function of the hidden states):

- every stage calls the model's forward with the model's own inputs: the first stage with what
  it is given, later stages with the token ids (``token_ids``, which `PipelineModel.step` then
  passes every stage), so positions, masks and shapes come out as in one process;
- the loop runs only the stage's layers (the split drops the others from the layer list);
- on later stages the ``before`` modules are stand-ins returning NaN shaped like the received
  hidden states, and the stage's first layer gets the received hidden states instead of its
  input: what the stand-ins produced is discarded (a NaN that leaks makes the loss NaN, never
  silently wrong);
- the forward ends after the stage's last layer (its output is the stage's output); the last
  stage then runs ``after`` on it, so the head gives logits for every position whatever the
  model's forward does after its layers (nanoGPT keeps only the last position without targets).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

Head = Callable[[nn.Module, torch.Tensor], Any]


class _StageDone(BaseException):
    """Raised after the stage's last layer to end the model's forward (a BaseException, so that a
    model's own ``except Exception`` cannot swallow it)."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


class _StandIn(nn.Module):
    """Takes the place of a module run before the layers, on a stage after the first."""

    def __init__(self, like: torch.Tensor) -> None:
        super().__init__()
        self.like = like

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full_like(self.like, float("nan")).detach()


def _hidden(output: Any) -> Any:
    """The hidden states in a layer's output (a layer returning a tuple puts them first)."""
    return output[0] if isinstance(output, tuple | list) else output


class LayerListForward:
    """A ``parallelize_fn`` that makes each stage run the model's own forward (see the module doc).

    ``LayerListForward(layers="transformer.h", before=["transformer.wte", "transformer.wpe",
    "transformer.drop"], after=["transformer.ln_f", "lm_head"])`` for nanoGPT. ``after`` may be a
    function ``(stage_module, hidden) -> output`` instead. To compose it with a parallelizer of
    your own (DDP, FSDP2), call it first: ``lambda stage, **kw: DDP(adapter(stage, **kw))``.
    """

    def __init__(self, *, layers: str, before: Sequence[str], after: Sequence[str] | Head) -> None:
        if not layers:
            raise ValueError("layers must name the model's layer list (e.g. 'transformer.h')")
        self.layers = layers
        self.before = list(before)
        self.after = after if callable(after) else list(after)

    def __call__(self, stage: nn.Module, *, stage_index: int, num_stages: int) -> nn.Module:
        return LayerListStage(
            stage,
            layers=self.layers,
            before=self.before,
            after=self.after,
            stage_index=stage_index,
            num_stages=num_stages,
        )


class LayerListStage(nn.Module):
    """One stage: the pruned model (whose children it shares, so parameter FQNs stay the full
    model's) run through the model's own forward, sliced at its layer list."""

    # Set with object.__setattr__: not registered as children (the stage shares the model's).
    _model: nn.Module
    _first_layer: nn.Module
    _last_layer: nn.Module
    after: list[str] | Head

    def __init__(
        self,
        stage: nn.Module,
        *,
        layers: str,
        before: list[str],
        after: list[str] | Head,
        stage_index: int,
        num_stages: int,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_modules", stage._modules)
        object.__setattr__(self, "_model", stage)
        self.stage_index, self.num_stages = stage_index, num_stages
        self.before = before
        object.__setattr__(self, "after", after)  # a module given as `after` must not become a child
        try:
            layer_list = stage.get_submodule(layers)
        except AttributeError:
            raise ValueError(f"pipeline stage {stage_index} has no layer list {layers!r}") from None
        held = [m for m in layer_list._modules.values() if m is not None]
        if not held:
            # Rule: the forward is cut after the stage's last layer, so every stage needs one.
            raise ValueError(
                f"pipeline stage {stage_index} holds none of the layers in {layers!r}; LayerListForward "
                "needs at least one layer in every stage's module_fqns_per_model_part"
            )
        object.__setattr__(self, "_first_layer", held[0])
        object.__setattr__(self, "_last_layer", held[-1])

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def needs_token_ids(self) -> bool:
        """Later stages run the model's forward from the token ids (`PipelineModel` passes them)."""
        return not self.is_first

    def forward(self, *args: Any, token_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        if self.is_first:
            hidden = self._run_to_exit(args, kwargs, received=None)
        else:
            if token_ids is None:
                raise ValueError(
                    f"pipeline stage {self.stage_index} runs the model's forward from the token ids: "
                    "pass token_ids (PipelineModel.step does)"
                )
            if len(args) != 1:
                raise ValueError(
                    f"pipeline stage {self.stage_index} expects the hidden states, got {len(args)} inputs"
                )
            hidden = self._run_to_exit((token_ids,), kwargs, received=args[0])
        return self._head(hidden) if self.is_last else hidden

    def _head(self, hidden: torch.Tensor) -> Any:
        if callable(self.after):
            return self.after(self._model, hidden)
        for fqn in self.after:
            hidden = self._model.get_submodule(fqn)(hidden)
        return hidden

    def _run_to_exit(self, args: tuple, kwargs: dict[str, Any], *, received: torch.Tensor | None) -> Any:
        """The model's forward up to the output of this stage's last layer."""

        def finish(_module: nn.Module, _inputs: Any, output: Any) -> None:
            raise _StageDone(_hidden(output))

        def hand_over(_module: nn.Module, inputs: tuple, layer_kwargs: dict) -> tuple[tuple, dict]:
            if not inputs:
                raise ValueError(
                    "LayerListForward: the layers must take the hidden states as first positional input"
                )
            return (received, *inputs[1:]), layer_kwargs

        handles = [self._last_layer.register_forward_hook(finish)]
        if received is not None:
            handles.append(self._first_layer.register_forward_pre_hook(hand_over, with_kwargs=True))
        try:
            with self._stand_ins(received):
                self._model(*args, **kwargs)
        except _StageDone as done:
            return done.output
        finally:
            for handle in handles:
                handle.remove()
        raise RuntimeError(
            f"pipeline stage {self.stage_index}: the model's forward returned without running its last "
            "layer; LayerListForward needs a forward that runs the layers of its layer list in order"
        )

    @contextmanager
    def _stand_ins(self, received: torch.Tensor | None) -> Iterator[None]:
        """On later stages, the ``before`` modules replaced for one call (absent ones added)."""
        if received is None:
            yield
            return
        saved: list[tuple[nn.Module, str, bool, nn.Module | None]] = []
        try:
            for fqn in self.before:
                parent_fqn, _, name = fqn.rpartition(".")
                parent = self._model.get_submodule(parent_fqn) if parent_fqn else self._model
                present = name in parent._modules
                saved.append((parent, name, present, parent._modules.get(name)))
                parent._modules[name] = _StandIn(received)
            yield
        finally:
            for parent, name, present, module in reversed(saved):
                if present:
                    parent._modules[name] = module
                else:
                    del parent._modules[name]
