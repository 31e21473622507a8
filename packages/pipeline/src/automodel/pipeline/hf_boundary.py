"""What a pipeline stage boundary carries besides the hidden states, read off the structure trace.

A later stage holds no module of the first stage and none of the earlier layers, so a value its
layers read that was computed there must be handed over with the hidden states. The trace
(`hf_structure.py`) labels values with where they were computed (`hf_dataflow.SourceTracker`);
from those labels this module decides what to carry:

- **Pre-layer values** that later stages cannot compute because they derive from the token ids or
  the input embeddings (Gemma 3n / 4's per-layer inputs, Zamba's and Inkling-2's copies of the
  embeddings): the outputs of the modules nearest to what the layers read (`carried_pre_modules`).
  The first stage sends them; later stages run the model's forward from the token ids, as the
  first stage does, and their stand-ins for those modules return the received values, so every
  layer gets exactly the slice of them it gets in one process.
- **Entries a layer writes into a mapping the model hands every layer** that later layers read
  (Gemma 3n / 4's key/value states shared across layers, ``num_kv_shared_layers``): the stage exit
  sends the entries present when the next layer would be called, the next stage puts them back
  into its own mapping before its first layer (`carried_entries`).

Gradients flow back through both to the stage that computed them. Any other value a layer reads
from an earlier layer besides the hidden states (a hidden state kept from several layers back, a
tensor stored on a module) cannot be carried: `check_cross_layer_reads` refuses it.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from automodel.pipeline.hf_dataflow import SourceTracker, tensors_in

if TYPE_CHECKING:  # hf_trace records into a LayerIO with this module's helpers
    from automodel.pipeline.hf_trace import LayerIO

#: Label prefixes on the tracker's nearest channel: computed inside layer i; an output of layer i;
#: an entry layer i wrote into a mapping handed to every layer.
INSIDE, OUTPUT, ENTRY = "layer:", "layer-output:", "layer-entry:"
#: Label of the token ids on the tracker's sources channel.
TOKEN_IDS = "<input_ids>"


class BoundaryError(ValueError):
    """What a layer reads cannot be handed over at a stage boundary; the message says why."""


@dataclass(frozen=True)
class EntrySpec:
    """One carried entry: ``container[key]`` of the mapping a layer gets as `loc` (a keyword, or
    ``argument i`` for the i-th positional argument), a tensor (``leaves == -1``) or a tuple of
    ``leaves`` tensors."""

    loc: str
    key: Hashable
    leaves: int

    def collect(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        value = container_at(args, kwargs, self.loc)[self.key]
        return [value] if self.leaves < 0 else list(value)

    def restore(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> None:
        target = container_at(args, kwargs, self.loc)
        target[self.key] = tensors[0] if self.leaves < 0 else tuple(tensors)

    @property
    def num_tensors(self) -> int:
        return 1 if self.leaves < 0 else self.leaves


def container_at(args: tuple, kwargs: dict, loc: str) -> MutableMapping:
    """The mapping a layer call gets as `loc` (see `EntrySpec`)."""
    if loc.startswith("argument "):
        return args[int(loc.split()[1])]
    return kwargs[loc]


def layer_inputs(args: tuple, kwargs: dict) -> dict[str, Any]:
    """A layer call's inputs besides the hidden states, by location (`EntrySpec.loc`)."""
    return {**{f"argument {i}": a for i, a in enumerate(args[1:], 1)}, **kwargs}


# ---- recording, from the trace's layer hooks --------------------------------------------------
def record_containers(index: int, args: tuple, kwargs: dict, io: LayerIO) -> None:
    """Before layer `index` runs: the mappings it is handed and what they hold."""
    found = []
    for loc, value in layer_inputs(args, kwargs).items():
        if isinstance(value, MutableMapping):
            held = {key: tuple(id(t) for t in tensors_in(v)) for key, v in value.items()}
            shapes = {key: _leaves(v) for key, v in value.items()}
            found.append((loc, value, held, shapes))
    io.containers[index] = found


def record_writes(index: int, io: LayerIO, tracker: SourceTracker) -> None:
    """After layer `index` ran: the entries it wrote into the mappings it was handed, relabelled as
    its entries (a later layer reading them reads an entry, which can be carried)."""
    writes = io.writes.setdefault(index, set())
    for loc, value, held, _ in io.containers.get(index, []):
        for key, entry in value.items():
            tensors = tensors_in(entry)
            if held.get(key) != tuple(id(t) for t in tensors):
                writes.add((loc, key))
                tracker.replace(tensors, (), nearest=[f"{ENTRY}{index}"])


def _leaves(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        return -1
    if isinstance(value, tuple | list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return len(value)
    return None


# ---- deciding ------------------------------------------------------------------------------------
def _index(label: str, prefix: str) -> int | None:
    return int(label[len(prefix) :]) if label.startswith(prefix) else None


def _cross_reads(labels: set[str], reader: int) -> tuple[set[int], set[str]]:
    """(layers whose entries `reader` reads, labels of other values of earlier layers it reads).
    Its own computations and its hidden input (the previous layer's output) are not cross reads."""
    entries, other = set(), set()
    for label in labels:
        if (k := _index(label, ENTRY)) is not None:
            entries.add(k)
        elif (k := _index(label, INSIDE)) is not None and k != reader:
            other.add(f"values computed inside layer {k}")
        elif (k := _index(label, OUTPUT)) is not None and k != reader - 1:
            other.add(f"the output of layer {k}")
    return entries, other


def check_cross_layer_reads(io: LayerIO, *, num_layers: int, post: list[str], model_type: str) -> set[int]:
    """The layers whose mapping entries later layers or post-layer modules read; `BoundaryError`
    if anything else computed by an earlier layer is read besides the hidden states."""
    readers = [(f"decoder layer {j}", j, io.layer_nearest.get(j, set())) for j in range(num_layers)]
    readers += [(f, num_layers, io.module_nearest.get(f, set())) for f in post]
    read_entries: set[int] = set()
    for name, index, labels in readers:
        entries, other = _cross_reads(labels, index)
        if other:
            raise BoundaryError(
                f"model_type {model_type!r}: {name} reads {sorted(other)} besides the hidden states, "
                "which a pipeline stage boundary between them would cut (only the hidden states, "
                "values computed before the layers and entries of a mapping handed to every layer are carried)"
            )
        read_entries |= entries
    return read_entries


def carried_entries(
    io: LayerIO, *, num_layers: int, read_entries: set[int], model_type: str
) -> tuple[tuple[EntrySpec, ...], ...]:
    """Per layer b: the entries a stage ending before layer b sends (present when layer b is called,
    written by an earlier layer whose entries are read). Empty tuples when nothing is carried."""
    if not read_entries:
        return ()
    containers = io.containers
    writes = io.writes
    _check_same_container_everywhere(containers, read_entries, writes, num_layers, model_type)
    per_layer: list[tuple[EntrySpec, ...]] = []
    for b in range(num_layers):
        specs = []
        for loc, _, held, shapes in containers.get(b, []):
            for key in held:
                writer = max((k for k in range(b) if (loc, key) in writes.get(k, set())), default=None)
                if writer is None or writer not in read_entries:
                    continue
                if shapes[key] is None:
                    raise BoundaryError(
                        f"model_type {model_type!r}: layer {writer} stores {key!r} in the mapping its layers get as "
                        f"{loc!r} as something other than a tensor or a tuple of tensors; a pipeline stage "
                        "boundary cannot carry it"
                    )
                specs.append(EntrySpec(loc=loc, key=key, leaves=shapes[key]))
        per_layer.append(tuple(specs))
    return tuple(per_layer)


def _check_same_container_everywhere(
    containers: dict[int, list],
    read_entries: set[int],
    writes: dict[int, set],
    num_layers: int,
    model_type: str,
) -> None:
    """The entries are restored into the mapping a later stage's model hands its layers: every layer
    must get one, at the same place, the same object within one forward."""
    locs = {loc for k in read_entries for loc, _ in writes.get(k, set())}
    for loc in sorted(locs):
        objects = [
            next((c for name, c, _, _ in containers.get(i, []) if name == loc), None)
            for i in range(num_layers)
        ]
        if any(o is None or o is not objects[0] for o in objects):
            raise BoundaryError(
                f"model_type {model_type!r}: its decoder layers read entries earlier layers write into the "
                f"mapping passed as {loc!r}, but not every layer gets that same mapping, so a pipeline stage "
                "cannot put the carried entries back"
            )


def carried_pre_modules(
    io: LayerIO,
    *,
    pre: list[str],
    post: list[str],
    num_layers: int,
    calls: dict[str, int],
    model_type: str,
) -> list[str]:
    """The modules run before the layers whose outputs later layers or post-layer modules read
    without another module in between (in the order the forward runs them): handing these over
    lets a later stage recompute everything else the layers read with the model's own code."""
    nearest = io.layer_nearest
    read = set().union(*(nearest.get(j, set()) for j in range(1, num_layers)))
    read |= set().union(*(io.module_nearest.get(f, set()) for f in post))
    carried = [f for f in pre if f in read]
    repeated = [f for f in carried if calls.get(f, 0) != 1]
    if repeated:
        raise BoundaryError(
            f"model_type {model_type!r}: its forward runs {repeated} more than once before the decoder layers, "
            "so a pipeline stage cannot tell which output its layers read"
        )
    return carried


def module_reads_of(io: LayerIO, fqns: list[str]) -> set[str]:
    """Every source the outputs of the modules `fqns` derive from (the sources channel)."""
    reads: Mapping[str, set[str]] = io.module_reads
    return set().union(*(reads.get(f, set()) for f in fqns))
