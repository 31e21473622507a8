"""A pipeline stage of a Hugging Face causal LM that runs the model's own ``forward``.

The stage holds the modules of its slice under their original FQNs. Its forward calls the
model's own forward (embedding scales, multipliers, per-layer attention types, rotary variants,
logit scaling and soft-capping all stay the model's code), with placeholders installed for the
duration of the call where the stage holds nothing:

- decoder layers before this stage's first layer pass their input through; the last of them
  hands over the hidden states received from the previous stage instead;
- the slot right after this stage's last layer stops the forward and returns the hidden states
  it is given (the stage output), so later layers, the final norm and the head never run;
- parameter-holding modules the model runs before the layers (embeddings, learned positions)
  are replaced on later stages by modules that only compute output shapes (on meta tensors)
  and return NaN: their values are discarded when the received hidden states are handed over,
  and a NaN that leaks anywhere else makes the loss NaN instead of silently wrong. Those whose
  outputs the layers read besides the hidden states (``HFStructure.shared_pre_fqns``) are held
  and run by every stage instead.

Later stages pass NaN ``inputs_embeds`` for the same reason: the model computes positions and
attention masks from shapes, exactly as in one process.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from automodel.pipeline.hf_structure import HFStructure


class _StageOutput(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the slot after a stage's last layer to end the model's forward early."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


class _RunState:
    """What the placeholders of one stage share during one forward."""

    def __init__(self) -> None:
        self.received: torch.Tensor | None = None
        self.handed_over = False
        self.device: torch.device | None = None


def _hidden_of(args: tuple, kwargs: dict, hidden_kwarg: str | None) -> torch.Tensor:
    return args[0] if args else kwargs[hidden_kwarg or "hidden_states"]


class _LayerPlaceholder(nn.Module):
    """A slot standing in for a decoder layer this stage does not hold.

    The model's forward may read the layer's attributes while iterating over its layers (its block
    type, to pick the mask): reads this placeholder cannot answer go to a meta copy of the layer.
    """

    def __init__(self, stands_for: nn.Module | None) -> None:
        super().__init__()
        self._stands_for = [stands_for]  # a list: not a submodule, so no parameters of this stage

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            target = self.__dict__.get("_stands_for", [None])[0]
            if target is None:
                raise
            return getattr(target, name)


class _SkippedLayer(_LayerPlaceholder):
    """A decoder layer of an earlier stage: passes hidden states on (the last one: the received ones)."""

    def __init__(
        self,
        *,
        state: _RunState,
        output_len: int,
        hidden_kwarg: str | None,
        hand_over: bool,
        stands_for: nn.Module | None = None,
    ) -> None:
        super().__init__(stands_for)
        self._state, self._output_len, self._hidden_kwarg, self._hand_over = (
            state,
            output_len,
            hidden_kwarg,
            hand_over,
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = _hidden_of(args, kwargs, self._hidden_kwarg)
        if self._hand_over:
            assert self._state.received is not None, "a later stage always receives hidden states"
            hidden = self._state.received
            self._state.handed_over = True
        return hidden if self._output_len == 0 else (hidden, *([None] * (self._output_len - 1)))


class _StageExit(_LayerPlaceholder):
    """The slot after a stage's last layer: its input is the stage's output."""

    def __init__(self, hidden_kwarg: str | None, stands_for: nn.Module | None = None) -> None:
        super().__init__(stands_for)
        self._hidden_kwarg = hidden_kwarg

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _StageOutput(_hidden_of(args, kwargs, self._hidden_kwarg))


class _Unreached(_LayerPlaceholder):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a pipeline stage ran past its exit slot")


class _ShapeOnly(nn.Module):
    """Stands in for a module that runs before the layers and lives on the first stage."""

    def __init__(self, *, fqn: str, meta_module: nn.Module, state: _RunState, stage_index: int) -> None:
        super().__init__()
        self._fqn, self._state, self._stage_index = fqn, state, stage_index
        self._meta = [meta_module]  # a list: not a submodule, so no parameters of this stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._state.handed_over:
            raise RuntimeError(
                f"pipeline stage {self._stage_index}: {self._fqn} ran after the decoder layers began, but the "
                "traced forward ran it before them (it lives on the first stage); this model cannot be split"
            )
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t.detach().to("meta"), (args, kwargs))
        with torch.no_grad():
            out = self._meta[0](*meta_args, **meta_kwargs)
        device = self._state.device

        def poison(t: torch.Tensor) -> torch.Tensor:
            fill = float("nan") if t.is_floating_point() or t.is_complex() else 0
            return torch.full(t.shape, fill, dtype=t.dtype, device=device)

        return tree_map_only(torch.Tensor, poison, out)


def _parent_and_name(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    parent, _, name = fqn.rpartition(".")
    return (root.get_submodule(parent) if parent else root), name


class CausalLMStage(nn.Module):
    """One pipeline stage: input token ids (first stage) or hidden states; output hidden states,
    or logits on the last stage. Parameter FQNs are those of the full model.

    The stage shares its children (the very dict) with `causal_lm`, a pruned shallow copy of the
    model (see `split_module`), whose own forward it calls.
    """

    def __init__(
        self,
        causal_lm: nn.Module,
        *,
        structure: HFStructure,
        stage_index: int,
        num_stages: int,
        layer_range: range,
        meta_modules: dict[str, nn.Module],
        meta_layers: dict[int, nn.Module] | None = None,
    ) -> None:
        super().__init__()
        object.__setattr__(self, "_modules", causal_lm._modules)
        object.__setattr__(self, "_causal_lm", causal_lm)
        # Models that derive positions from the input length take no position_ids (every stage
        # sees the whole sequence, so their own positions are right).
        self._takes_position_ids = "position_ids" in inspect.signature(type(causal_lm).forward).parameters
        self.config = causal_lm.config
        self.structure = structure
        self.stage_index, self.num_stages, self.layer_range = stage_index, num_stages, layer_range
        self._state = _RunState()
        meta_layers = meta_layers or {}
        slots: list[nn.Module | None] = []
        for i in range(structure.num_layers):
            if i < layer_range.start:
                slots.append(
                    _SkippedLayer(
                        state=self._state,
                        output_len=structure.layer_output_len,
                        hidden_kwarg=structure.hidden_kwarg,
                        hand_over=i == layer_range.start - 1,
                        stands_for=meta_layers.get(i),
                    )
                )
            elif i < layer_range.stop:
                slots.append(None)  # this stage's layer, looked up at call time (wrappers may replace it)
            elif i == layer_range.stop:
                slots.append(_StageExit(structure.hidden_kwarg, stands_for=meta_layers.get(i)))
            else:
                slots.append(_Unreached(meta_layers.get(i)))
        object.__setattr__(self, "_slots", slots)
        shadows = {}
        if not self.is_first:
            for fqn in structure.pre_fqns:
                if fqn in meta_modules:
                    shadows[fqn] = _ShapeOnly(
                        fqn=fqn, meta_module=meta_modules[fqn], state=self._state, stage_index=stage_index
                    )
        object.__setattr__(self, "_shadows", shadows)

    @property
    def causal_lm(self) -> nn.Module:
        """The pruned model whose forward this stage runs (its class and config are the model's:
        checkpoint loading reads transformers' weight mapping from it)."""
        return self._causal_lm

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def train(self, mode: bool = True) -> CausalLMStage:
        super().train(mode)
        self._causal_lm.training = mode  # the model's forward may read its own flag
        return self

    @contextlib.contextmanager
    def _placeholders(self) -> Iterator[None]:
        """Install the full-length layer list and the shadows for one call; always restore."""
        parent, name = _parent_and_name(self, self.structure.layers_fqn)
        held = parent._modules[name]
        full = nn.ModuleList()
        for i, slot in enumerate(self._slots):
            full._modules[str(i)] = held._modules[str(i)] if slot is None else slot
        restore = [(parent, name, held)]
        parent._modules[name] = full
        try:
            for fqn, shadow in self._shadows.items():
                owner, child = _parent_and_name(self, fqn)
                restore.append((owner, child, owner._modules.get(child)))
                owner._modules[child] = shadow
            yield
        finally:
            for owner, child, module in reversed(restore):
                owner._modules[child] = module

    def forward(
        self, inputs: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        if inputs.is_meta:  # torch < 2.13 infers stage shapes on meta tensors
            return self._output_shape_only(inputs)
        batch, seq = inputs.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(seq, device=inputs.device).unsqueeze(0).expand(batch, seq)
        state = self._state
        state.device, state.handed_over = inputs.device, False
        if self.is_first:
            call: dict[str, Any] = {"input_ids": inputs}
        else:
            state.received = inputs
            size = (batch, seq, self.structure.embed_size)
            call = {"inputs_embeds": torch.full(size, float("nan"), dtype=inputs.dtype, device=inputs.device)}
        try:
            if self._takes_position_ids:
                call["position_ids"] = position_ids
            with self._placeholders():
                out = self._causal_lm(**call, use_cache=False, **kwargs)
        except _StageOutput as stop:
            return stop.hidden
        finally:
            state.received = None
        assert self.is_last, f"stage {self.stage_index} ran the whole model"
        return out.logits if hasattr(out, "logits") else out[0]

    def _output_shape_only(self, inputs: torch.Tensor) -> torch.Tensor:
        batch, seq = inputs.shape[:2]
        params = [p for p in self.parameters() if p.is_floating_point()]
        dtype = inputs.dtype if inputs.is_floating_point() else (params[0].dtype if params else torch.float32)
        if self.is_last:
            width = self._causal_lm.get_output_embeddings().weight.shape[0]
        else:
            width = self.structure.hidden_size
        return torch.empty(batch, seq, width, dtype=dtype, device="meta")
