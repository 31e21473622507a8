"""The parallelizer API of the seed (NeMo AutoModel's `components.distributed.parallelizer`) is
importable from the package root and listed in `__all__`, so code written against it ports by
changing the import.

The names are the seed's public functions (its docs page, kept in the project's design notes),
except those of Megatron-FSDP's former name nvFSDP (`nvfsdp_strategy_parallelize`, `HAVE_NVFSDP`),
which live in `automodel.megatron_fsdp` as `MegatronFSDPManager`, and the private `_get_parallel_plan`,
whose public equivalent here is `resolve_tp_plan`.
"""

from __future__ import annotations

import inspect

import pytest

import automodel.fsdp2

SEED_PARALLELIZER_FUNCTIONS = (
    "apply_fsdp2_sharding_recursively",
    "get_hf_tp_shard_plan",
    "import_class_from_path",
    "import_classes_from_paths",
    "translate_to_torch_parallel_style",
    "validate_tp_mesh",
    "get_lm_ac_layers",
    "fsdp2_strategy_parallelize",
    "unshard_fsdp2_model",
)
#: the seed's FSDP2 config and manager (its `fsdp2` strategy docs)
SEED_CLASSES = ("FSDP2Manager", "DDPManager")


@pytest.mark.parametrize("name", SEED_PARALLELIZER_FUNCTIONS + SEED_CLASSES)
def test_seed_name_is_exported_from_the_package_root(name: str) -> None:
    from automodel import fsdp2

    obj = getattr(fsdp2, name)
    assert callable(obj)
    assert name in automodel.fsdp2.__all__


def test_seed_helpers_behave_as_documented() -> None:
    from torch import nn

    from automodel.fsdp2 import get_lm_ac_layers, import_class_from_path, import_classes_from_paths

    assert import_class_from_path("torch.optim.AdamW").__name__ == "AdamW"
    assert [c.__name__ for c in import_classes_from_paths(["torch.nn.Linear", "torch.nn.ReLU"])] == [
        "Linear",
        "ReLU",
    ]
    assert "tp_mesh" in inspect.signature(automodel.fsdp2.validate_tp_mesh).parameters

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))

    model = Model()
    assert get_lm_ac_layers(model) == list(model.model.layers)


def test_every_exported_name_resolves() -> None:
    missing = [n for n in automodel.fsdp2.__all__ if not hasattr(automodel.fsdp2, n)]
    assert not missing, missing
