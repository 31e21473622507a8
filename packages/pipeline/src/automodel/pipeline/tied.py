"""Tied weights across pipeline stages (input embedding = LM head): one weight, several copies.

The first stage uses the weight as the embedding, the last as the head. Each holds a copy under
the weight's name in the model, or under the place it holds (``head.weight`` where only the embedding
is ``emb.weight``: a copy of its own, made by the split), initialised or loaded identically. After backward, the copies'
gradients are summed over the stages holding them, so every copy takes the same optimizer step
and the tie holds exactly, as in one process. For the gradient norm, one copy counts. The weights
of a module every stage runs (a position table read by every layer) are copies of one weight alike;
frozen ones (``requires_grad=False``) get no gradient, as in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from automodel.mesh import MeshContext
from automodel.pipeline.wrappers import named_parameters_in_model, unwrap


def untie_advice(*, hf_model: bool, place: str = "lm_head.weight") -> str:
    """How to untie a weight, for an error message: the config key of a transformers model, plain
    torch otherwise (a separate `nn.Parameter` at the weight's second place, `place`)."""
    if hf_model:
        return "build the model with tie_word_embeddings=False"
    return (
        "untie the weights in your model before build, e.g. "
        f"`model.{place} = nn.Parameter(model.{place}.detach().clone())`"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return t.to_local() if isinstance(t, DTensor) else t


class TiedParameters:
    """The tied weights of this rank's stages and the groups of ranks that hold their copies."""

    def __init__(
        self, entries: list[tuple[str, list[nn.Parameter], dist.ProcessGroup | None]], duplicates: set[int]
    ) -> None:
        self._entries = entries
        self._duplicates = duplicates
        self._one_process_names: dict[int, str] = {}

    @classmethod
    def none(cls) -> TiedParameters:
        return cls([], set())

    @classmethod
    def build(
        cls,
        *,
        mesh: MeshContext,
        holders: dict[str, list[int]],
        held_as: dict[str, dict[int, str]] | None = None,
        stage_ids_per_rank: dict[int, list[int]],
        model_parts: list[nn.Module],
        part_stage_ids: list[int] | None = None,
        hf_model: bool = False,
    ) -> TiedParameters:
        """Collective over the world: every rank makes the same process groups in the same order.

        `holders` (tied weight name: stage ids) must be the same on every rank (taken from the
        whole model before the split); each rank then finds its copies in its own stages by name:
        the one in `holders`, or where `held_as` (name: stage id: name in that stage) says the stage
        holds it under another (a head tied to an embedding the stage does not hold).
        """
        if not holders:
            return cls.none()
        layout, me = mesh.layout, mesh.rank
        pp_rank_of = {s: r for r, stages in stage_ids_per_rank.items() for s in stages}
        pp_groups = sorted({tuple(layout.group_ranks(r, "pp")) for r in range(mesh.world_size)})
        my_pp = layout.group_ranks(me, "pp").index(me)
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        entries, duplicates, renamed = [], set(), {}
        for name in sorted(holders):
            stages = holders[name]
            holder_pp = tuple(sorted({pp_rank_of[s] for s in stages}))
            if holder_pp not in groups:
                groups[holder_pp] = None
                if len(holder_pp) > 1:
                    for pp_group in pp_groups:  # every rank creates every group (new_group is collective)
                        group = dist.new_group([pp_group[i] for i in holder_pp])
                        if me in (pp_group[i] for i in holder_pp):
                            groups[holder_pp] = group
            if my_pp not in holder_pp:
                continue
            copies = []
            for i, part in enumerate(model_parts):
                # by full-model name: a stage wrapped by parallelize_fn (DDP: module.<fqn>) holds it too
                params = dict(named_parameters_in_model(part, remove_duplicate=False))
                stage_of_part = part_stage_ids[i] if part_stage_ids is not None else None
                if stage_of_part is None:
                    stage_of_part = getattr(unwrap(part), "stage_index", min(stages))
                local = (held_as or {}).get(name, {}).get(stage_of_part, name)
                if local in params:
                    copies.append(params[local])
                    if local != name:
                        renamed[id(params[local])] = name
                    if stage_of_part != min(stages):
                        duplicates.add(id(params[local]))
            # Kept even without copies: the check below then fails on every rank alike.
            entries.append((name, copies, groups[holder_pp]))
        tied = cls(entries, duplicates)
        tied._one_process_names = renamed
        tied._check(
            mesh,
            holders,
            {n: tuple(sorted({pp_rank_of[s] for s in st})) for n, st in holders.items()},
            hf_model=hf_model,
        )
        return tied

    def _check(
        self,
        mesh: MeshContext,
        holders: dict[str, list[int]],
        holder_pp: dict[str, tuple[int, ...]],
        *,
        hf_model: bool = False,
    ) -> None:
        """Every holder must have its copies, laid out alike, or summing their gradients is wrong (or,
        worse, the ranks issue different collectives and hang). One gather over the world, so every
        rank sees every rank's copies and all raise the same error together."""
        mine = {name: sorted({tuple(_local(p).shape) for p in copies}) for name, copies, _ in self._entries}
        gathered: list[object] = [None] * mesh.world_size
        dist.all_gather_object(gathered, mine)
        layout = mesh.layout
        for name in sorted(holders):
            # Copies are summed within one pp group (same dp/tp/cp coordinates): compare there.
            shapes: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
            for rank, held in enumerate(gathered):
                assert isinstance(held, dict)
                pp_group = tuple(layout.group_ranks(rank, "pp"))
                if pp_group.index(rank) not in holder_pp[name]:
                    continue
                if not held.get(name):
                    raise ValueError(
                        f"rank {rank} runs a pipeline stage holding the tied weight {name} (stages "
                        f"{holders[name]}) but has no copy of it under that name or the one its stage holds "
                        "it as; the stage must hold a module the weight has in one process, under the name "
                        "it has there (names are read through "
                        "DistributedDataParallel and torch.compile around a stage; another wrapper that "
                        "renames parameters must go inside the stage, around its submodules)"
                    )
                shapes.setdefault(pp_group, set()).update(tuple(s) for s in held[name])
            for found in shapes.values():
                if len(found) > 1:
                    raise ValueError(
                        f"the pipeline stages holding the tied weight {name} shard it differently "
                        f"({sorted(found)} local shapes); keep it replicated over tp (the same placements "
                        f"on every stage holding it) or {untie_advice(hf_model=hf_model)}"
                    )

    def release_process_groups(self) -> None:
        """Forget the groups (at teardown: `PipelineModel.release_process_groups`)."""
        self._entries = [(name, copies, None) for name, copies, _ in self._entries]

    def duplicate_ids(self) -> set[int]:
        """Ids of the copies not counted in a gradient norm (all but the lowest stage's)."""
        return set(self._duplicates)

    def one_process_names(self) -> dict[int, str]:
        """By parameter id, the one-process name of the copies a stage holds under another name."""
        return dict(self._one_process_names)

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self._entries]

    @torch.no_grad()
    def begin_accumulation(self) -> None:
        """Before a backward that adds to synced gradients: keep the sum in one copy (the lowest
        stage's) and zero the others, so the sync after it adds each copy's new part once."""
        for _, copies, _ in self._entries:
            for p in copies:
                if id(p) in self._duplicates and p.grad is not None:
                    _local(p.grad).zero_()

    @torch.no_grad()
    def sync_gradients(self) -> None:
        for _, copies, group in self._entries:
            if not any(p.requires_grad for p in copies):
                continue  # frozen (the same on every rank, so every rank skips it alike)
            grads = []
            for p in copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(_local(p.grad))
            total = grads[0].clone()
            for g in grads[1:]:
                total += g
            if group is not None:
                dist.all_reduce(total, group=group)
            for g in grads:
                g.copy_(total)
