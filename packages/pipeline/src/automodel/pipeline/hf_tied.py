"""Which modules around the decoder layers hold weights tied across them (input embedding = LM head).

The first and the last stage both hold them (see `hf.hf_module_fqns_per_stage`), each under the
weight's one-process name; `tied.TiedParameters` keeps the copies equal while training.
"""

from __future__ import annotations

from torch import nn

from automodel.mesh.model_parts import parameter_places
from automodel.pipeline.split import PipelineSplitError, is_within


def tied_modules_between(model: nn.Module, pre: list[str], post: list[str], *, model_type: str) -> list[str]:
    """The largest modules inside the pre- and post-modules whose parameters are all shared between
    the two sides: a whole module (Llama's embed_tokens, lm_head) or, where the module also holds
    weights of its own, a submodule of it (BERT's word embeddings inside ``bert.embeddings``).

    The last stage holds the pre-side ones next to the head, so its copy of a tied weight has the
    name it has in one process (initialization seeds and checkpoint keys go by that name).
    """
    tied = {
        pid
        for pid, places in parameter_places(model).items()
        if any(is_within(m, pre) for m, _ in places) and any(is_within(m, post) for m, _ in places)
    }
    found: list[str] = []

    def visit(fqn: str, module: nn.Module) -> None:
        ids = {id(p) for p in module.parameters()}
        if ids and ids <= tied:
            found.append(fqn)
        elif ids & tied:
            for name, child in module.named_children():
                visit(f"{fqn}.{name}", child)

    for fqn in (*pre, *post):
        visit(fqn, model.get_submodule(fqn))
    covered = {id(p) for f in found if is_within(f, pre) for p in model.get_submodule(f).parameters()}
    loose = [n for n, p in model.named_parameters() if id(p) in tied and id(p) not in covered]
    if loose:
        # Rule: a tied weight must sit in a module of its own on the input side, which the last
        # stage can hold under the weight's one-process name.
        raise PipelineSplitError(
            f"model_type {model_type!r}: the weights {loose} are tied between the modules run before and "
            "after the decoder layers but held directly by a module with other weights, so the last "
            "pipeline stage cannot hold its copy under the same name; build it with tie_word_embeddings=False"
        )
    named_first = {}  # the name one process gives each weight (its first)
    for name, p in model.named_parameters():
        named_first.setdefault(id(p), name)
    outside = [
        named_first[i] for i in sorted(tied) if not any(named_first[i].startswith(f + ".") for f in found)
    ]
    if outside:
        # Rule: one process names a tied weight by its first place in the model; both the first
        # and the last stage must hold the module of that place, or their copies' names differ.
        raise PipelineSplitError(
            f"model_type {model_type!r}: its tied weights {outside} are named in one process after a place "
            "(the head, registered before the embeddings) that no stage but the last can hold, so the "
            "stages' copies would be initialized and loaded under different names; build it with "
            "tie_word_embeddings=False"
        )
    return found
