"""The training loss of a causal LM without its full logits: the model's forward runs unchanged
except that its output head (``lm_head``) records the hidden states it is given and returns
zero-width logits; the loss is then computed from the recorded hidden states and the head's
weight by `linear_cross_entropy_sum`, chunked over tokens.

Why swap the head and not call the decoder alone: the whole forward runs, so FSDP2's root hooks
(the head's weight is a root parameter, unsharded for the step), pipeline stages and the model's
own pre-head code (scaling, norms) all stay as they are. What a family applies to the logits
*after* the head is not seen by the swapped head; it is probed before launch on the meta model
(`plan_head_loss`): a pass-through (Llama, Qwen, Mistral, ...), a tanh soft-cap
(``final_logit_softcapping``: Gemma 2/3) and a scale (``logit_scale``: Cohere;
``logits_scaling``: Granite) are reproduced in the chunked loss after a numeric check of the
model's own code; anything else keeps the full-logits loss, said in one log line.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from automodel.mesh.model_parts import output_embeddings
from automodel.recipes.linear_ce import linear_cross_entropy_sum

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

LogitsLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class HeadPlan:
    """How the loss reads the model: through its head's weight (`fqn` set) or its logits."""

    fqn: str | None  # the output head's module FQN; None: full logits
    softcap: float | None = None
    scale: float | None = None
    reason: str = ""  # why full logits

    @property
    def chunked(self) -> bool:
        return self.fqn is not None

    def describe(self) -> str:
        if not self.chunked:
            return f"loss: full-logits cross-entropy ({self.reason})"
        extra = "".join(
            f", {k} {v:g}"
            for k, v in (("soft-cap", self.softcap), ("logit scale", self.scale))
            if v is not None
        )
        return f"loss: chunked linear cross-entropy over {self.fqn} (no full logits{extra})"


def _expected_transform(config: PretrainedConfig, model: nn.Module) -> tuple[float | None, float | None]:
    """The soft-cap and scale a family's config declares for its logits (checked by the probe)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(model, "logit_scale", None)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        scale = getattr(text, "logit_scale", None)
    logits_scaling = getattr(text, "logits_scaling", None)
    if isinstance(logits_scaling, (int, float)) and logits_scaling not in (0, 1):
        scale = (scale or 1.0) / logits_scaling
    softcap = float(softcap) if isinstance(softcap, (int, float)) and softcap else None
    scale = float(scale) if isinstance(scale, (int, float)) and scale != 1 else None
    return softcap, scale


class _ProbeHead(nn.Module):
    """Stands in for the head on the meta model: returns real values the model's post-head code acts on."""

    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.values = values

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.values.expand(*hidden.shape[:-1], self.values.shape[-1])


class _StubOutput(dict):
    """A decoder's output holding only the last hidden state (other fields read as None)."""

    def __getattr__(self, name: str) -> Any:
        return self.get(name)

    def __getitem__(self, key: Any) -> Any:
        return self["last_hidden_state"] if key == 0 else dict.__getitem__(self, key)

    def to_tuple(self) -> tuple:
        return (self["last_hidden_state"],)


class _StubDecoder(nn.Module):
    """Stands in for the decoder on the meta model: the head's input without running any layer."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, *args: Any, **kwargs: Any) -> _StubOutput:
        return _StubOutput(last_hidden_state=self.hidden)


def _swap(root: nn.Module, fqn: str, module: nn.Module) -> nn.Module:
    """Put `module` at `fqn` in `root`; returns the module that was there."""
    parent_fqn, _, name = fqn.rpartition(".")
    parent = root.get_submodule(parent_fqn) if parent_fqn else root
    held = getattr(parent, name, None)
    assert isinstance(held, nn.Module), f"{fqn} is empty"
    setattr(parent, name, module)
    return held


def _transform(values: torch.Tensor, softcap: float | None, scale: float | None) -> torch.Tensor:
    out = values.double()
    if scale is not None:
        out = out * scale
    if softcap is not None:
        out = torch.tanh(out / softcap) * softcap
    return out


def plan_head_loss(model: nn.Module) -> HeadPlan:
    """Decide, on the meta-device model, whether the chunked loss reproduces the model's logits loss.

    The head must be a plain `nn.Linear`; the model's code after it is probed: its forward runs with
    the decoder standing in (meta hidden states, no layer runs) and the head standing in as a
    source of known logits, and what the model returns must be those logits, or their soft-capped /
    scaled values as the config declares.
    """
    head = output_embeddings(model)
    if head is None:
        return HeadPlan(None, reason=f"{type(model).__name__} has no output embeddings")
    if type(head).forward is not nn.Linear.forward or not isinstance(head, nn.Linear):
        return HeadPlan(None, reason=f"its head is a {type(head).__name__}, not a plain nn.Linear")
    fqn = next((n for n, m in model.named_modules(remove_duplicate=False) if m is head), None)
    if not fqn:
        return HeadPlan(None, reason="its head is not a submodule of the model")
    softcap, scale = _expected_transform(model.config, model)
    prefix = getattr(model, "base_model_prefix", "")
    decoder = getattr(model, prefix, None) if prefix else None
    decoder = decoder if isinstance(decoder, nn.Module) else None
    if decoder is None:
        return HeadPlan(None, reason=f"its decoder is not at base_model_prefix {prefix!r}")
    probe = torch.linspace(-60.0, 60.0, 24, dtype=torch.float32).reshape(1, 1, 24)
    hidden = torch.zeros(1, 4, head.in_features, device="meta")
    held_head = _swap(model, fqn, _ProbeHead(probe))
    held_decoder = _swap(model, prefix, _StubDecoder(hidden))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"), use_cache=False)
        logits = out.logits if hasattr(out, "logits") else out[0]
    except Exception as e:  # noqa: BLE001 - the model's own code failed on the stand-ins: keep its path
        return HeadPlan(
            None, reason=f"its code after the decoder could not be probed ({type(e).__name__}: {e})"
        )
    finally:
        _swap(model, prefix, held_decoder)
        _swap(model, fqn, held_head)
    expected = _transform(probe, softcap, scale)
    if (
        not isinstance(logits, torch.Tensor)
        or logits.is_meta
        or logits.shape[-1] != probe.shape[-1]
        or not torch.allclose(logits.double().reshape(-1, 24)[0], expected.reshape(24), rtol=1e-5, atol=1e-5)
    ):
        return HeadPlan(
            None,
            reason=f"model_type {getattr(model.config, 'model_type', '?')!r} changes its logits after the head "
            "in a way the chunked loss does not reproduce",
        )
    return HeadPlan(fqn, softcap=softcap, scale=scale)


class _RecordingHead(nn.Module):
    """Stands in for the head during a forward: records the hidden states it is given and returns
    zero-width logits ``[..., 0]`` (what the model does to them after the head costs nothing; the
    loss reads the recorded hidden states)."""

    out_features = 0  # what a pipeline's last stage emits per token meanwhile

    def __init__(self, pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self._pending = pending  # (returned zero-width logits, recorded hidden states) per call

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # zero-width but in the graph of `hidden` (not a view): the loss adds their (zero) sum, so
        # the backward passes through the model's output, where FSDP2's root unshards its
        # parameters for backward (a root that resharded after forward would otherwise not)
        local = hidden.to_local() if isinstance(hidden, DTensor) else hidden
        empty = local.narrow(-1, 0, 0)
        if tuple(local.shape) != tuple(hidden.shape):  # a sequence-sharded DTensor: its global shape
            empty = empty.sum(dim=1, keepdim=True).expand(*hidden.shape[:-1], 0)
        logits = empty.clone()
        self._pending.append((logits, hidden))
        return logits


class HeadLoss:
    """``loss(output, labels)`` for the loop and the pipeline's last stage, summed over tokens.

    Chunked: run the model inside `capturing`; the loss reads the hidden states the head was given
    and the head's weight (never the returned output). Full logits: `logits_loss(output, labels)`.
    """

    def __init__(self, plan: HeadPlan, *, logits_loss: LogitsLoss, chunk_tokens: int | None = None) -> None:
        self.plan = plan
        self.logits_loss = logits_loss
        self.chunk_tokens = chunk_tokens
        self._head: nn.Module | None = None
        self._holder: nn.Module | None = None
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._active = False
        self._held: nn.Module | None = None  # the real head while the recording one stands in
        #: the chunked path's loss on (hidden, weight, labels): ours, or Liger's fused kernel
        #: (``kernels.liger``: fused_linear_cross_entropy), with `linear_ce.linear_cross_entropy_sum`'s contract
        self.linear_loss: Callable[..., torch.Tensor] = linear_cross_entropy_sum
        self.linear_loss_name = ""

    def describe(self) -> str:
        """The start-up line of the loss path (the plan's, naming a replaced linear loss)."""
        line = self.plan.describe()
        if self.plan.chunked and self.linear_loss_name:
            line = line.replace("chunked linear cross-entropy", self.linear_loss_name)
        return line

    def bind(self, parts: list[nn.Module], *, unwrap: Callable[[nn.Module], nn.Module] = lambda m: m) -> None:
        """Find the head among this rank's model parts (a pipeline rank without the last stage has
        none) and hook the part holding it: inside `capturing`, each forward of that part runs with
        the recording head in place, and the real head is back before anything else (backward
        included: a zero-bubble schedule reads the part's parameters then). A head that is its own
        FSDP unit is unsharded only inside its own forward, which the chunked loss skips: such a
        layout keeps full logits."""
        if not self.plan.chunked:
            return

        assert self.plan.fqn is not None
        for part in parts:
            holder = unwrap(part)
            if getattr(holder, "is_last", True) is False:
                continue  # a pipeline stage before the last (with tied weights it may hold a head copy)
            try:
                head = holder.get_submodule(self.plan.fqn)
            except AttributeError:
                continue
            if isinstance(head, FSDPModule):
                self.plan = HeadPlan(None, reason=f"{self.plan.fqn} is its own FSDP unit in this layout")
                return
            self._head, self._holder = head, holder
            holder.register_forward_pre_hook(self._install)
            holder.register_forward_hook(self._restore, always_call=True)
            return

    def _install(self, module: nn.Module, args: Any) -> None:
        if self._active and self._held is None:
            assert self.plan.fqn is not None
            self._held = _swap(module, self.plan.fqn, _RecordingHead(self._pending))

    def _restore(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._held is not None:
            assert self.plan.fqn is not None
            _swap(module, self.plan.fqn, self._held)
            self._held = None

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Forwards of the model part holding the head record its input instead of computing logits."""
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self._pending.clear()

    def take_hidden(self, output: torch.Tensor) -> torch.Tensor:
        """The hidden states recorded by the forward that returned `output` (the model's logits
        are the recording head's own return for most families), else by the latest forward: the
        loop and torch's pipeline schedules compute each loss right after its forward. Older
        records (a schedule's shape-inference run) are dropped."""
        match = next((i for i, (logits, _) in enumerate(self._pending) if logits is output), None)
        _, hidden = self._pending[-1 if match is None else match]
        self._pending.clear()
        return hidden

    def __call__(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.plan.chunked:
            return self.logits_loss(output, labels)
        if self._head is None or not self._pending:
            raise RuntimeError(
                f"the chunked loss found no hidden states recorded by {self.plan.fqn} "
                "(run the model inside HeadLoss.capturing)"
            )
        hidden = self.take_hidden(output)
        head = self._head
        loss = self.linear_loss(
            hidden,
            head.weight,
            labels,
            bias=head.bias,
            chunk_tokens=self.chunk_tokens,
            softcap=self.plan.softcap,
            scale=self.plan.scale,
        )
        if isinstance(output, torch.Tensor) and output.requires_grad and output.numel() == 0:
            loss = (
                loss + output.sum()
            )  # zero: links the model's output into the backward (see _RecordingHead)
        return loss


def is_linear_loss(loss_fn: Any) -> bool:
    """Whether a configured loss asks for the chunked path (`automodel.recipes.loss.LinearCrossEntropy`)."""
    return bool(getattr(loss_fn, "reads_hidden_states", False))


def build_head_loss(loss_fn: Any, *, model: nn.Module, logits_loss: LogitsLoss) -> HeadLoss:
    """The loop's loss for `loss_fn` on `model` (still on the meta device); logs how it reads the model."""
    if is_linear_loss(loss_fn):
        plan = plan_head_loss(model)
        chunk = getattr(loss_fn, "chunk_tokens", None)
    else:
        plan, chunk = HeadPlan(None, reason="loss_fn reads logits"), None
        logits_loss = loss_fn
    if not math.isfinite(plan.softcap or 0.0) or not math.isfinite(plan.scale or 0.0):
        plan = HeadPlan(None, reason="non-finite soft-cap or logit scale in the config")
    return HeadLoss(plan, logits_loss=logits_loss, chunk_tokens=chunk)
