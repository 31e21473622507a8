"""Model facts have one home, `automodel.mesh.model_parts`: the packages that read them call it, and
no package defines a finder, config reader or wrapper-name canonicaliser of its own."""

from __future__ import annotations

import ast
from pathlib import Path

import automodel.moe
from automodel.fsdp2 import meta_init, tp_checks, tp_hf_plan, tp_llama_plan
from automodel.megatron_fsdp import optimizer
from automodel.mesh import layout_report, model_parts
from automodel.recipes import model as recipes_model

ROOT = Path(__file__).resolve().parents[1]
#: Names model_parts defines that no other package's source may define again.
FACTS = {
    "canonical_fqn",
    "canonical_name",
    "_canonical",
    "_WRAPPER_ATOM",
    "_WRAPPER_ATOMS",
    "WRAPPER_ATOMS",
    "find_decoder_layers",
    "named_decoder_layers",
    "layer_values",
    "positive_ints",
    "head_dims",
    "_config_int",
    "config_int",
    "num_experts",
    "experts_per_token",
}


def test_the_readers_are_model_parts() -> None:
    assert meta_init.canonical_fqn is layout_report.canonical_fqn is optimizer.canonical_fqn
    assert optimizer.canonical_fqn is model_parts.canonical_fqn
    assert tp_hf_plan.head_dims is tp_llama_plan.head_dims is model_parts.head_dims
    assert tp_checks.positive_ints is model_parts.positive_ints
    assert recipes_model.num_experts is model_parts.num_experts
    assert recipes_model.experts_per_token is model_parts.experts_per_token
    assert recipes_model.layer_values is model_parts.layer_values
    assert not hasattr(automodel.moe, "find_decoder_layers")


def test_no_package_defines_them_again() -> None:
    home = ROOT / "packages" / "mesh" / "src" / "automodel" / "mesh" / "model_parts.py"
    again = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        if path == home:
            continue
        for node in ast.parse(path.read_text()).body:
            names = (
                [node.name]
                if isinstance(node, ast.FunctionDef | ast.ClassDef)
                else [t.id for t in node.targets if isinstance(t, ast.Name)]
                if isinstance(node, ast.Assign)
                else []
            )
            again += [f"{path.relative_to(ROOT)}: {n}" for n in names if n in FACTS]
    assert again == []
