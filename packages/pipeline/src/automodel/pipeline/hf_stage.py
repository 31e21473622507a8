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

What later layers read besides the hidden states but later stages cannot compute crosses the
boundary with them (see `hf_boundary`): a stage's output is then ``(hidden, *carried)``. The
first stage sends the outputs of the pre-layer modules that make those values (Gemma's per-layer
inputs, a copy of the embeddings); later stages run the model's forward from the token ids (the
``token_ids`` keyword `PipelineModel` then passes) exactly as the first stage does, their
stand-ins for those modules returning the received values, so the model's own code slices and
combines them for every layer as in one process. Entries layers write into a mapping handed to
every layer (a key/value cache shared across layers) are collected by the exit slot and put back
by the hand-over slot. Gradients flow back through all of them to the first stage's modules and
the earlier layers.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from automodel.mesh.model_parts import output_embeddings
from automodel.pipeline.dtensor_boundary import sendable
from automodel.pipeline.hf_placeholders import (
    ContiguousGrad,
    RunState,
    SkippedLayer,
    StageExit,
    StageOutput,
    Unreached,
    stand_in,
)
from automodel.pipeline.hf_structure import HFStructure
from automodel.pipeline.torch_internals import tree_leaves, tree_map_only


def _parent_and_name(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    parent, _, name = fqn.rpartition(".")
    return (root.get_submodule(parent) if parent else root), name


class CausalLMStage(nn.Module):
    """One pipeline stage: input token ids (first stage) or hidden states; output hidden states,
    or logits on the last stage. Parameter FQNs are those of the full model.

    Where the model's layers read values a later stage cannot compute (`HFStructure.carried_pre_fqns`,
    `HFStructure.carried_entries`), a stage's input and output are ``(hidden, *carried)`` instead,
    and later stages take the token ids as ``token_ids`` (see the module docstring).

    The stage shares its children (the very dict) with `causal_lm`, a pruned shallow copy of the
    model (see `split_module`), whose own forward it calls.
    """

    # Set with object.__setattr__ (not registered as children: the stage shares the model's).
    _causal_lm: nn.Module
    _slots: list[nn.Module | None]
    _shadows: dict[str, nn.Module]

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
        self._state = RunState()
        object.__setattr__(self, "_slots", self._make_slots(meta_layers or {}))
        shadows = {}
        if not self.is_first:
            for fqn in structure.pre_fqns:
                if fqn in meta_modules:
                    shadows[fqn] = stand_in(
                        fqn,
                        meta_modules[fqn],
                        state=self._state,
                        stage_index=stage_index,
                        structure=structure,
                    )
        object.__setattr__(self, "_shadows", shadows)

    def _make_slots(self, meta_layers: dict[int, nn.Module]) -> list[nn.Module | None]:
        structure, layer_range = self.structure, self.layer_range
        slots: list[nn.Module | None] = []
        for i in range(structure.num_layers):
            if i < layer_range.start:
                hand_over = i == layer_range.start - 1
                slots.append(
                    SkippedLayer(
                        state=self._state,
                        output_len=structure.layer_output_len,
                        hidden_kwarg=structure.hidden_kwarg,
                        hand_over=hand_over,
                        stands_for=meta_layers.get(i),
                        entries=structure.entries_at(layer_range.start) if hand_over else (),
                    )
                )
            elif i < layer_range.stop:
                slots.append(None)  # this stage's layer, looked up at call time (wrappers may replace it)
            elif i == layer_range.stop:
                entries = structure.entries_at(layer_range.stop)
                slots.append(
                    StageExit(structure.hidden_kwarg, stands_for=meta_layers.get(i), entries=entries)
                )
            else:
                slots.append(Unreached(meta_layers.get(i)))
        return slots

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

    @property
    def needs_token_ids(self) -> bool:
        """Whether this stage runs the model from the token ids (``token_ids``): a later stage of a
        model whose layers read pre-layer values it is handed (see `HFStructure.carried_pre_fqns`)."""
        return not self.is_first and bool(self.structure.carried_pre_fqns)

    @property
    def carries(self) -> bool:
        """Whether this stage receives or sends more than the hidden states."""
        start, stop = self.layer_range.start, self.layer_range.stop
        return bool(self.structure.carried_tensors_at(start) or self.structure.carried_tensors_at(stop))

    def train(self, mode: bool = True) -> CausalLMStage:
        super().train(mode)
        self._causal_lm.training = mode  # the model's forward may read its own flag
        return self

    @contextlib.contextmanager
    def _placeholders(self) -> Iterator[None]:
        """Install the full-length layer list and the shadows for one call, and record the outputs
        of the carried pre-layer modules; always restore."""
        parent, name = _parent_and_name(self, self.structure.layers_fqn)
        held = parent._modules[name]
        full = nn.ModuleList()
        for i, slot in enumerate(self._slots):
            full._modules[str(i)] = held._modules[str(i)] if slot is None else slot
        restore = [(parent, name, held)]
        parent._modules[name] = full
        handles = []
        try:
            for fqn, shadow in self._shadows.items():
                owner, child = _parent_and_name(self, fqn)
                restore.append((owner, child, owner._modules.get(child)))
                owner._modules[child] = shadow
            if not self.is_last:
                for fqn in self.structure.carried_pre_fqns:
                    handles.append(self.get_submodule(fqn).register_forward_hook(self._recorder(fqn)))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for owner, child, module in reversed(restore):
                owner._modules[child] = module

    def _recorder(self, fqn: str) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._state.values[fqn] = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]

        return hook

    def forward(
        self,
        inputs: torch.Tensor,
        *received: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if inputs.is_meta:  # torch < 2.13 infers stage shapes on meta tensors
            return self._output_shape_only(inputs, received, position_ids, token_ids, kwargs)
        state = self._state
        state.reset(inputs.device)
        if self.is_first:
            call: dict[str, Any] = {"input_ids": inputs}
            batch, seq = inputs.shape[:2]
        else:
            if self.carries:
                inputs, *rest = (ContiguousGrad.apply(t) for t in (inputs, *received))
                received = tuple(rest)
            state.received = inputs
            self._take_received(tuple(received))
            call, (batch, seq) = self._later_stage_call(inputs, token_ids)
        if position_ids is None:
            position_ids = torch.arange(seq, device=inputs.device).unsqueeze(0).expand(batch, seq)
        try:
            if self._takes_position_ids:
                call["position_ids"] = position_ids
            with self._placeholders():
                out = self._causal_lm(**call, use_cache=False, **kwargs)
        except StageOutput as stop:
            return self._stage_output(stop)
        finally:
            state.received = None
        assert self.is_last, f"stage {self.stage_index} ran the whole model"
        return out.logits if hasattr(out, "logits") else out[0]

    def _later_stage_call(
        self, inputs: torch.Tensor, token_ids: torch.Tensor | None
    ) -> tuple[dict[str, Any], tuple[int, int]]:
        """The model's inputs on a later stage: the token ids where it is handed pre-layer values
        (its forward then takes the first stage's path), else NaN ``inputs_embeds``."""
        if self.needs_token_ids:
            if token_ids is None:
                raise ValueError(
                    f"pipeline stage {self.stage_index} of model_type {self.structure.model_type!r} runs the model "
                    "from the token ids (its layers read values made from them before the layers): pass token_ids"
                )
            batch, seq = token_ids.shape[:2]
            return {"input_ids": token_ids}, (batch, seq)
        batch, seq = inputs.shape[:2]
        size = (batch, seq, self.structure.embed_size)
        embeds = torch.full(size, float("nan"), dtype=inputs.dtype, device=inputs.device)
        return {"inputs_embeds": embeds}, (batch, seq)

    def _take_received(self, received: tuple[torch.Tensor, ...]) -> None:
        """Split what the previous stage sent besides the hidden states: carried pre-layer outputs
        (by module), then mapping entries."""
        expected = self.structure.carried_tensors_at(self.layer_range.start)
        assert len(received) == expected, (
            f"pipeline stage {self.stage_index} received {len(received)} tensors besides the hidden states, "
            f"expected {expected}"
        )
        start = 0
        for fqn, count in zip(self.structure.carried_pre_fqns, self.structure.carried_pre_tensors):
            self._state.carried_in[fqn] = list(received[start : start + count])
            start += count
        self._state.entries_in = list(received[start:])

    def _stage_output(self, stop: StageOutput) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The hidden states, then (where the boundary carries more) the carried pre-layer outputs
        and the mapping entries."""
        # Contiguous and not a view: keys and values are usually transposed views, and so are some
        # layers' hidden states (Inkling-2's convolutions); a value passed on unchanged is a view.
        hidden = sendable(stop.hidden)
        if not self.structure.carried_tensors_at(self.layer_range.stop):
            return hidden
        carried: list[torch.Tensor] = []
        for fqn in self.structure.carried_pre_fqns:
            if fqn not in self._state.values:
                raise RuntimeError(
                    f"pipeline stage {self.stage_index}: {fqn} did not run before the decoder layers, but the "
                    "traced forward ran it and its output is handed to later stages"
                )
            carried += self._state.values[fqn]
        return (hidden, *(sendable(t) for t in (*carried, *stop.entries)))

    def _output_shape_only(
        self,
        inputs: torch.Tensor,
        received: tuple[torch.Tensor, ...] = (),
        position_ids: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.carries:
            return self._shapes_by_running(inputs, received, position_ids, token_ids, kwargs or {})
        batch, seq = inputs.shape[:2]
        params = [p for p in self.parameters() if p.is_floating_point()]
        dtype = inputs.dtype if inputs.is_floating_point() else (params[0].dtype if params else torch.float32)
        if self.is_last:
            head = output_embeddings(self._causal_lm)
            # `out_features` first: a head standing in for the real one may emit another width
            # (a loss reading the hidden states swaps in one that returns zero-width logits)
            width = getattr(head, "out_features", None)
            if not isinstance(width, int):
                weight = None if head is None else head.weight
                if not isinstance(weight, torch.Tensor):
                    raise RuntimeError(
                        f"pipeline stage {self.stage_index} is the last but holds no output embedding weight"
                    )
                width = weight.shape[0]
        else:
            width = self.structure.hidden_size
        return torch.empty(batch, seq, width, dtype=dtype, device="meta")

    @torch.no_grad()
    def _shapes_by_running(
        self,
        inputs: torch.Tensor,
        received: tuple[torch.Tensor, ...],
        position_ids: torch.Tensor | None,
        token_ids: torch.Tensor | None,
        kwargs: dict[str, Any],
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The output shapes of a stage that carries more than hidden states (its carried values'
        shapes are the model's): one forward on placeholder data (zeros, NaN) of the given shapes."""
        param = next(iter(self.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")

        def real(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DTensor):  # a received DTensor (`dtensor_boundary`) keeps its layout
                local = real(t.to_local())
                return DTensor.from_local(
                    local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
                )
            fill = float("nan") if t.is_floating_point() else 0
            return torch.full(t.shape, fill, dtype=t.dtype, device=device)

        args = tree_map_only(torch.Tensor, real, (inputs, *received))
        extra = tree_map_only(
            torch.Tensor, real, {"position_ids": position_ids, "token_ids": token_ids, **kwargs}
        )
        out = self.forward(*args, **extra)
        return tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), out)
