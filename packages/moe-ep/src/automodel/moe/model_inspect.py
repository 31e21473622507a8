"""Find the experts modules of a Hugging Face (transformers 5) MoE model and how EP can run them.

This module is the one home of the rule deciding what expert parallelism supports; the
pre-launch checks (recipes) and `apply_ep` both call `check_expert_parallel_support`.

An *experts module* holds every expert of a block stacked: each of its own parameters has one
row per expert on dim 0 (``gate_up_proj`` [E, 2I, H], ``down_proj_bias`` [E, H], ...) and at
least one is 3-D. It is found by structure, not class name: the ``experts`` child of a block, or
a module whose ``num_experts`` attribute equals that E (JetMoE's ``input_linear``). An ``experts``
module without parameters of its own may keep them in descendants as flat rows, E blocks of k
rows on dim 0 (DBRX's ``mlp.w1`` [E*F, H], its ``num_experts`` = E): block e is expert e, so
those are split the same way and named by their dotted path (``mlp.w1``). How EP runs it
depends on its forward's call signature (the calling convention its block uses):

- ``forward(hidden_states, top_k_index, top_k_weights)``: index-routed (Mixtral, GPT-OSS,
  Nemotron-H...). Tokens go to their experts' owners, which run the module's own forward.
- ``forward(rows, expert_size)``: rows sorted by expert with per-expert counts (JetMoE).
- ``forward(rows)``: E equal blocks of rows, block e for expert e (Llama 4's dense bmm).

Experts kept as the rows of ``nn.Embedding`` tables of a block with ``num_experts`` rows (Doge's
single-neuron retrieval experts) are split too: each lookup fetches rows from their owner rank.

Index-routed modules with exactly the SwiGLU layout of `grouped_gemm` (concatenated gate/up, no
bias, ``act_fn``, the default gate) use the grouped-GEMM fast path instead of their own forward.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass

import torch
from torch import nn


class ExpertsLayout(enum.Enum):
    """How an experts module is called, hence how its tokens are dispatched."""

    SWIGLU = "swiglu"  # index-routed, computed by the grouped-GEMM fast path
    INDEX_ROUTED = "index_routed"  # forward(hidden_states, top_k_index, top_k_weights)
    SORTED_ROWS = "sorted_rows"  # forward(rows sorted by expert, expert_size)
    EXPERT_BLOCKS = "expert_blocks"  # forward(rows in E equal blocks)
    EXPERT_ROWS = "expert_rows"  # an nn.Embedding whose row e is expert e (Doge's retrieval experts)


_LAYOUT_BY_ARITY = {
    3: ExpertsLayout.INDEX_ROUTED,
    2: ExpertsLayout.SORTED_ROWS,
    1: ExpertsLayout.EXPERT_BLOCKS,
}

#: Flags transformers' ``use_experts_implementation`` sets, at the values the fast path implements.
_SWIGLU_FLAGS = {
    "has_bias": False,
    "is_transposed": False,
    "is_concatenated": True,
    "has_gate": True,
    "has_post_expert_norm": False,
}


@dataclass(frozen=True)
class MoEBlock:
    """One experts module of a model, and the module that owns it."""

    name: str  # FQN of the owning block
    block: nn.Module
    experts: nn.Module
    num_experts: int
    experts_name: str = ""  # FQN of the experts module
    layout: ExpertsLayout = ExpertsLayout.SWIGLU
    #: the expert parameters, relative to `experts` (dotted where a descendant holds them: ``mlp.w1``)
    param_names: tuple[str, ...] = ("gate_up_proj", "down_proj")


def expert_parameter(experts: nn.Module, name: str) -> torch.Tensor:
    """The parameter `name` of `experts` (a `MoEBlock.param_names` entry, dotted for a descendant's)."""
    owner, _, leaf = name.rpartition(".")
    return getattr(experts.get_submodule(owner), leaf)


def _own_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return dict(module.named_parameters(recurse=False, remove_duplicate=False))


def _flat_expert_params(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """Expert parameters an ``experts`` module keeps in descendants as flat rows, `num_experts`
    blocks of k rows on dim 0 (DBRX's ``mlp.w1`` [E*F, H]), by dotted name; None if it is not so.

    A module per expert (a ModuleList of MLPs) is another layout, whose rows are not experts.
    """
    count = getattr(module, "num_experts", None)
    if _own_params(module) or not (isinstance(count, int) and count > 1):
        return None
    if any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in module.modules()):
        return None
    params: dict[str, torch.Tensor] = dict(module.named_parameters())
    if params and all(p.dim() >= 1 and p.shape[0] % count == 0 for p in params.values()):
        return params
    return None


def _forward_arity(module: nn.Module) -> int | None:
    """Positional parameters of the module's forward, self excluded (decorators followed)."""
    try:
        signature = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in signature.parameters.values() if p.kind in kinds) - 1


def _is_default_gate(module: nn.Module) -> bool:
    gate = getattr(type(module), "_apply_gate", None)
    return gate is None or getattr(gate, "__name__", "") == "_default_apply_gate"


def is_stacked_experts(module: nn.Module) -> bool:
    """True for the SwiGLU layout: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I] and nothing else."""
    params = _own_params(module)
    gate_up, down = params.get("gate_up_proj"), params.get("down_proj")
    if set(params) != {"gate_up_proj", "down_proj"} or gate_up.dim() != 3 or down.dim() != 3:
        return False
    experts, two_inter, hidden = gate_up.shape
    return down.shape[0] == experts and down.shape[1] == hidden and two_inter == 2 * down.shape[2]


def _uses_swiglu_fast_path(module: nn.Module) -> bool:
    flags_ok = all(getattr(module, k, v) == v for k, v in _SWIGLU_FLAGS.items())
    return (
        is_stacked_experts(module)
        and flags_ok
        and callable(getattr(module, "act_fn", None))
        and _is_default_gate(module)
    )


def _is_candidate(leaf: str, module: nn.Module) -> bool:
    """Holds stacked per-expert parameters: a 3-D own parameter, and named ``experts`` or counting them."""
    params = _own_params(module)
    if not any(p.dim() >= 3 for p in params.values()):
        return False
    count = getattr(module, "num_experts", None)
    return leaf == "experts" or any(isinstance(count, int) and p.shape[0] == count for p in params.values())


def _uneven_rows(name: str, module: nn.Module, params: dict[str, torch.Tensor]) -> str | None:
    """Why stacked own parameters with different row counts cannot be split; None if all agree."""
    rows = {n: p.shape[0] for n, p in params.items()}
    if len(set(rows.values())) == 1:
        return None
    fewest = min(rows.values())
    longer = ", ".join(n for n, r in rows.items() if r > fewest)
    return (
        f"experts module {name!r} ({type(module).__name__}) has parameters with different expert counts on "
        f"dim 0 ({rows}): expert parallelism splits every expert parameter Shard(0) so that each rank holds "
        f"the same experts' rows of all of them, which needs one row per expert in each; rows {fewest}.. of "
        f"{longer} have no counterpart in the others (e.g. parameter-free identity ('zero') experts the "
        "forward computes without them), and Shard(0) would cut the parameters at different rows, leaving "
        "an expert's rows on different ranks"
    )


def _classify(name: str, module: nn.Module) -> ExpertsLayout | str:
    """The layout EP runs `module` with, or why it cannot."""
    where = f"experts module {name!r} ({type(module).__name__})"
    layout = getattr(module, "_ep_layout", None)  # already expert parallel: its class says
    if layout is not None:
        return layout
    arity = _forward_arity(module)
    layout = _LAYOUT_BY_ARITY.get(arity)
    if layout is None:
        return (
            f"{where} has forward with {arity} positional arguments; expert parallelism runs experts "
            "called as (hidden_states, top_k_index, top_k_weights), (rows sorted by expert, expert_size) "
            "or (rows in one block per expert)"
        )
    if layout is ExpertsLayout.INDEX_ROUTED and _uses_swiglu_fast_path(module):
        return ExpertsLayout.SWIGLU
    return layout


def _expert_tables(module: nn.Module) -> list[tuple[str, nn.Embedding]]:
    """Embedding children with one row per expert of `module` (its ``num_experts``)."""
    count = getattr(module, "num_experts", None)
    if not isinstance(count, int) or count < 2:
        return []
    return [
        (n, child)
        for n, child in module.named_children()
        if isinstance(child, nn.Embedding) and child.num_embeddings == count
    ]


def _classify_table(name: str, table: nn.Embedding) -> ExpertsLayout | str:
    """Expert rows are fetched from their owner rank; options that act on the whole table cannot be."""
    options = {"padding_idx": table.padding_idx, "max_norm": table.max_norm, "sparse": table.sparse or None}
    set_options = {k: v for k, v in options.items() if v is not None}
    if set_options or getattr(type(table), "forward", None) is not nn.Embedding.forward:
        return (
            f"expert table {name!r} ({type(table).__name__}) is not a plain nn.Embedding lookup "
            f"({set_options or 'its own forward'}); expert parallelism fetches rows from the rank owning them"
        )
    return ExpertsLayout.EXPERT_ROWS


def _scan(model: nn.Module) -> tuple[list[MoEBlock], list[str]]:
    """The splittable experts modules, and why the others are not (once per class, first one named)."""
    blocks: list[MoEBlock] = []
    problems: list[tuple[str, str]] = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        for child, table in _expert_tables(module):
            fqn = f"{name}.{child}" if name else child
            layout = _classify_table(fqn, table)
            if isinstance(layout, str):
                problems.append((type(table).__name__, layout))
                continue
            blocks.append(
                MoEBlock(
                    name=name,
                    block=module,
                    experts=table,
                    num_experts=table.num_embeddings,
                    experts_name=fqn,
                    layout=layout,
                    param_names=("weight",),
                )
            )
        leaf = name.rsplit(".", 1)[-1]
        flat = _flat_expert_params(module) if name and leaf == "experts" else None
        if not name or (flat is None and not _is_candidate(leaf, module)):
            continue
        params = flat if flat is not None else _own_params(module)
        problem = _uneven_rows(name, module, params) if flat is None else None
        layout = problem or _classify(name, module)
        if isinstance(layout, str):
            problems.append((type(module).__name__, layout))
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        blocks.append(
            MoEBlock(
                name=parent,
                block=modules[parent],
                experts=module,
                num_experts=module.num_experts if flat is not None else next(iter(params.values())).shape[0],
                experts_name=name,
                layout=layout,
                param_names=tuple(params),
            )
        )
    first: dict[str, str] = {}
    for cls, text in problems:
        first.setdefault(cls, text)
    counts = {cls: sum(1 for c, _ in problems if c == cls) for cls in first}
    return blocks, [
        text + (f" (and {counts[c] - 1} more)" if counts[c] > 1 else "") for c, text in first.items()
    ]


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every experts module expert parallelism can split, in module order."""
    return _scan(model)[0]


def check_expert_parallel_support(
    model: nn.Module, *, declared_experts: int | None = None, allow_dense: bool = False
) -> list[MoEBlock]:
    """The experts modules of `model`; ValueError naming each one expert parallelism cannot split.

    Also refuses a model without any experts module (a dense model, or experts kept elsewhere)
    unless `allow_dense` (a pipeline stage holding only dense layers); `declared_experts`, the
    expert count the model's config declares, makes that message precise.
    """
    blocks, problems = _scan(model)
    if problems:
        raise ValueError("; ".join(problems))
    if not blocks and not allow_dense:
        built = (
            f"its config declares {declared_experts} experts but the built model"
            if declared_experts
            else "it"
        )
        raise ValueError(
            f"{built} has no experts module (a module named `experts`, or with a `num_experts` attribute, "
            "whose own parameters hold one row per expert on dim 0, one of them 3-D; an `experts` module "
            "whose descendants hold num_experts blocks of rows on dim 0; or embedding tables "
            "with one row per expert): a dense model has "
            "nothing for expert parallelism to split; use ep_size=1 for dense models"
        )
    return blocks
