"""The modules a pipeline stage installs while it runs the model's own forward (see `hf_stage`).

Slots for the decoder layers the stage does not hold (`SkippedLayer` before its first layer, the
last of which hands the received hidden states over; `StageExit` right after its last layer, which
stops the forward; `Unreached` beyond), shape-only stand-ins for the pre-layer modules of earlier
stages (`ShapeOnly`, made by `stand_in`), and the per-call state they share (`RunState`). Public so
that tests (and other stage implementations) can build and check them one by one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from automodel.pipeline.hf_boundary import EntrySpec
from automodel.pipeline.hf_structure import HFStructure
from automodel.pipeline.torch_internals import tree_map_only


class StageOutput(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the slot after a stage's last layer to end the model's forward early."""

    def __init__(self, hidden: torch.Tensor, entries: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.hidden = hidden
        self.entries = entries or []


class RunState:
    """What the placeholders of one stage share during one forward."""

    def __init__(self) -> None:
        self.received: torch.Tensor | None = None
        self.handed_over = False
        self.device: torch.device | None = None
        #: carried pre-layer outputs received from the previous stage, by module FQN
        self.carried_in: dict[str, list[torch.Tensor]] = {}
        #: carried mapping entries received from the previous stage (put back at the hand-over)
        self.entries_in: list[torch.Tensor] = []
        #: the carried pre-layer modules' outputs of this forward (computed, or received), by FQN
        self.values: dict[str, list[torch.Tensor]] = {}

    def reset(self, device: torch.device) -> None:
        self.device, self.handed_over, self.received = device, False, None
        self.carried_in, self.entries_in, self.values = {}, [], {}


def hidden_of(args: tuple, kwargs: dict, hidden_kwarg: str | None) -> torch.Tensor:
    return args[0] if args else kwargs[hidden_kwarg or "hidden_states"]


class LayerPlaceholder(nn.Module):
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


class SkippedLayer(LayerPlaceholder):
    """A decoder layer of an earlier stage: passes hidden states on (the last one: the received ones)."""

    def __init__(
        self,
        *,
        state: RunState,
        output_len: int,
        hidden_kwarg: str | None,
        hand_over: bool,
        stands_for: nn.Module | None = None,
        entries: tuple[EntrySpec, ...] = (),
    ) -> None:
        super().__init__(stands_for)
        self._state, self._output_len, self._hidden_kwarg, self._hand_over = (
            state,
            output_len,
            hidden_kwarg,
            hand_over,
        )
        self._entries = entries  # put back into the mappings the layers get (the hand-over slot)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = hidden_of(args, kwargs, self._hidden_kwarg)
        if self._hand_over:
            assert self._state.received is not None, "a later stage always receives hidden states"
            hidden = self._state.received
            self._state.handed_over = True
            restore_entries(self._entries, args, kwargs, self._state.entries_in)
        return hidden if self._output_len == 0 else (hidden, *([None] * (self._output_len - 1)))


def restore_entries(
    entries: tuple[EntrySpec, ...], args: tuple, kwargs: dict, tensors: list[torch.Tensor]
) -> None:
    start = 0
    for entry in entries:
        entry.restore(args, kwargs, tensors[start : start + entry.num_tensors])
        start += entry.num_tensors
    assert start == len(tensors), f"received {len(tensors)} entry tensors, put back {start}"


class StageExit(LayerPlaceholder):
    """The slot after a stage's last layer: its input is the stage's output (with the entries of the
    mappings it is handed that later layers read)."""

    def __init__(
        self,
        hidden_kwarg: str | None,
        stands_for: nn.Module | None = None,
        entries: tuple[EntrySpec, ...] = (),
    ) -> None:
        super().__init__(stands_for)
        self._hidden_kwarg, self._entries = hidden_kwarg, entries

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        entries = [t for entry in self._entries for t in entry.collect(args, kwargs)]
        raise StageOutput(hidden_of(args, kwargs, self._hidden_kwarg), entries)


class Unreached(LayerPlaceholder):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a pipeline stage ran past its exit slot")


class ShapeOnly(nn.Module):
    """Stands in for a module that runs before the layers and lives on the first stage: returns
    NaN of its output's shape, or (`carried`) the output the first stage computed and sent.

    The model's forward may read the module's weights directly (Gemma 4 reads the padding row of
    its embedding): tensors read off it are NaN of their shape (a broadcast scalar, no memory)."""

    def __init__(
        self, *, fqn: str, meta_module: nn.Module, state: RunState, stage_index: int, carried: bool = False
    ) -> None:
        super().__init__()
        self._fqn, self._state, self._stage_index, self._carried = fqn, state, stage_index, carried
        self._meta = [meta_module]  # a list: not a submodule, so no parameters of this stage

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            meta = self.__dict__.get("_meta", [None])[0]
            if meta is None:
                raise
            value = getattr(meta, name)
            if isinstance(value, torch.Tensor):
                nan = torch.full((), float("nan"), dtype=value.dtype, device=self._state.device)
                return nan.expand(value.shape)
            return value

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._state.handed_over:
            raise RuntimeError(
                f"pipeline stage {self._stage_index}: {self._fqn} ran after the decoder layers began, but the "
                "traced forward ran it before them (it lives on the first stage); this model cannot be split"
            )
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t.detach().to("meta"), (args, kwargs))
        with torch.no_grad():
            out = self._meta[0](*meta_args, **meta_kwargs)
        if self._carried:
            return self._received_like(out)
        device = self._state.device

        def poison(t: torch.Tensor) -> torch.Tensor:
            fill = float("nan") if t.is_floating_point() or t.is_complex() else 0
            return torch.full(t.shape, fill, dtype=t.dtype, device=device)

        return tree_map_only(torch.Tensor, poison, out)

    def _received_like(self, out: Any) -> Any:
        """`out` (meta) with its tensors replaced, in order, by the received ones."""
        received = iter(self._state.carried_in[self._fqn])

        def take(t: torch.Tensor) -> torch.Tensor:
            got = next(received)
            if got.shape != t.shape:
                raise RuntimeError(
                    f"pipeline stage {self._stage_index}: received a {tuple(got.shape)} output of {self._fqn} "
                    f"from the previous stage, but this forward computes it as {tuple(t.shape)}"
                )
            return got

        return tree_map_only(torch.Tensor, take, out)


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradients of a stage's inputs are
    sent to the previous stage as they are, and p2p sends need contiguous tensors (the gradient of
    a carried key/value state is a transposed view)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def stand_in(
    fqn: str, meta_module: nn.Module, *, state: RunState, stage_index: int, structure: HFStructure
) -> nn.Module:
    """The stand-in for a pre-layer module; for a ModuleList / ModuleDict (the model calls the
    modules inside it, Gemma 3n's ``altup_projections``) a container of stand-ins."""
    if isinstance(meta_module, nn.ModuleList | nn.ModuleDict):
        container = type(meta_module)()
        for name, child in meta_module.named_children():
            container._modules[name] = stand_in(
                f"{fqn}.{name}", child, state=state, stage_index=stage_index, structure=structure
            )
        return container
    return ShapeOnly(
        fqn=fqn,
        meta_module=meta_module,
        state=state,
        stage_index=stage_index,
        carried=fqn in structure.carried_pre_fqns,
    )
