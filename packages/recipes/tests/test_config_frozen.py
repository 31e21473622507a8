"""The config layer is typed, frozen and a leaf (issues 39, 50): every config dataclass reachable from
`RecipeConfig` is frozen, no section field and no parameter that takes a config is `Any`, and
`automodel.recipes.config` imports no behaviour and reads no disk (the file checks run before launch)."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from automodel.mesh import StrategyConfig
from automodel.recipes import load_config
from automodel.recipes.config.distributed import DistributedSection
from automodel.recipes.config.recipe import DatasetConfig, RecipeConfig
from automodel.recipes.data.kinds import kinds
from automodel.recipes.errors import ConfigError
from automodel.recipes.launch_check import check_launch
from automodel.recipes.parallelisms import parallelisms
from automodel.recipes.strategies import get_strategy, strategy_names

sys.path.insert(0, str(Path(__file__).parent))
from _recipe_helpers import tiny_config  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src" / "automodel" / "recipes"
REPO = Path(__file__).resolve().parents[3]
CONFIG_PACKAGE = SRC / "config"
#: Reachable config dataclasses of packages this change does not own, not frozen yet (named, so a
#: new one fails): automodel.moe's config belongs to the EP work of issue 39.
NOT_FROZEN_YET: set[str] = set()


def _leaves(hint: object) -> list[object]:
    """The classes a type hint names (through unions, generics, ClassVar, InitVar)."""
    if isinstance(hint, dataclasses.InitVar):
        return _leaves(hint.type)
    origin = typing.get_origin(hint)
    if origin is typing.ClassVar:
        return []
    if origin is not None:
        out: list[object] = [] if origin in (typing.Union, types.UnionType) else [origin]
        for arg in typing.get_args(hint):
            out += _leaves(arg)
        return out
    return [hint]


def _expand(cls: object) -> list[type]:
    """A Protocol or base class of the config stands for the classes registered under it."""
    if cls is DatasetConfig:
        return [c for k in kinds() for c in (k.section, k.validation_section)]
    if cls is StrategyConfig:
        return [get_strategy(name).config_class() for name in strategy_names()]
    if cls is DistributedSection:  # each parallelism's own section is typed by its plugin
        return [cls, *(c for p in parallelisms() if (c := p.config_class()) is not None)]
    return [cls] if isinstance(cls, type) else []


def config_types(root: type, *, localns: dict[str, object] | None = None) -> list[type]:
    """Every dataclass (but torch's) reachable from `root`'s field hints (registered kinds and strategies
    included); `localns`: names of classes defined in a test function."""
    seen: list[type] = []
    todo: list[type] = [root]
    while todo:
        cls = todo.pop()
        if cls in seen or not dataclasses.is_dataclass(cls) or cls.__module__.startswith("torch."):
            continue  # torch's policies (MixedPrecisionPolicy, OffloadPolicy) are torch's
        seen.append(cls)
        for hint in typing.get_type_hints(cls, localns=localns).values():
            for leaf in _leaves(hint):
                todo += _expand(leaf)
    return seen


def not_frozen(root: type, *, localns: dict[str, object] | None = None) -> list[str]:
    return [c.__name__ for c in config_types(root, localns=localns) if not c.__dataclass_params__.frozen]  # type: ignore[attr-defined]


def any_fields(root: type) -> list[str]:
    """``Class.field`` for every field of a reachable config dataclass whose hint holds `Any`."""
    return [
        f"{cls.__name__}.{name}"
        for cls in config_types(root)
        for name, hint in typing.get_type_hints(cls).items()
        if any(leaf is Any for leaf in _leaves(hint))
    ]


#: Parameter names that take a config: a recipe (``cfg``), a section, a package's or the model's
#: config (``*_config``: hf_config, strategy_config, pipeline_config), the LoRA section and what
#: carries it (``peft``, ``lora``). (``pipeline`` names the built pipeline, not its config.)
CONFIG_PARAMETER = re.compile(r"^(cfg|config|section|peft|lora)$|_(cfg|config|section)$")


def _bare_any(annotation: ast.expr) -> bool:
    """Whether `annotation` is `Any` or a union with `Any` (a string annotation is parsed): a raw
    YAML mapping (``dict[str, Any]``) is data, not a config, and passes."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _bare_any(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.Name | ast.Attribute):
        return ast.unparse(annotation) in ("Any", "typing.Any")
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _bare_any(annotation.left) or _bare_any(annotation.right)
    if isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) in ("Optional", "Union"):
        inner = annotation.slice
        return any(_bare_any(e) for e in (inner.elts if isinstance(inner, ast.Tuple) else [inner]))
    return False


def any_config_params(source: str) -> list[str]:
    """``function(name)`` for every parameter (positional, keyword-only, ``*args``, ``**kwargs``)
    whose name takes a config (`CONFIG_PARAMETER`) annotated with `Any` in `source`."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            star = [x for x in (a.vararg, a.kwarg) if x is not None]
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *star]:
                if (
                    CONFIG_PARAMETER.search(arg.arg)
                    and arg.annotation is not None
                    and _bare_any(arg.annotation)
                ):
                    out.append(f"{getattr(node, 'name', 'lambda')}({arg.arg})")
    return out


def python_files() -> list[Path]:
    """Every Python file of the repository: each package's source and tests, the workspace tests,
    benchmarks and scripts (what the type checker reads)."""
    return [
        p for p in REPO.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(REPO).parts)
    ]


def test_every_config_dataclass_reachable_from_recipe_config_is_frozen() -> None:
    reached = {c.__name__ for c in config_types(RecipeConfig)}
    # the walk reaches the sections, every dataset kind's and every strategy's config, the pipeline's
    assert {
        "ModelSection",
        "SFTValidationDatasetSection",
        "NanogptValidationSection",
        "SquadSection",
    } <= reached
    assert {"FSDP2Config", "DDPConfig", "MegatronFSDPConfig", "SingleConfig", "PipelineConfig"} <= reached
    assert len(reached) >= 38, sorted(reached)
    assert set(not_frozen(RecipeConfig)) == NOT_FROZEN_YET


def test_the_frozen_walk_catches_a_mutable_section() -> None:
    @dataclasses.dataclass
    class Loose:
        x: int = 0

    @dataclasses.dataclass(frozen=True)
    class Holder:
        inner: Loose | None = None
        many: tuple[Loose, ...] = ()

    assert not_frozen(Holder, localns={"Loose": Loose}) == ["Loose"]


def test_no_section_field_and_no_config_parameter_is_any() -> None:
    assert any_fields(RecipeConfig) == []
    files = python_files()
    # every package's source and tests, the workspace tests, benchmarks and scripts; no exemption
    assert {SRC / "launch_check.py", REPO / "tests" / "conformance" / "tiny.py"} <= set(files)
    assert {p.relative_to(REPO).parts[0] for p in files} >= {"packages", "tests", "benchmarks", "scripts"}
    found = [f"{p.relative_to(REPO)}: {hit}" for p in files for hit in any_config_params(p.read_text())]
    assert found == []


def test_the_any_scans_catch_a_sample() -> None:
    @dataclasses.dataclass(frozen=True)
    class Sample:
        ok: int = 0
        loose: dict[str, Any] | None = None

    assert any_fields(Sample) == ["Sample.loose"]
    source = (
        "def f(cfg: Any) -> None: ...\n"
        "def g(*, section: 'Any | None', x: Any, raw: dict[str, Any]) -> None: ...\n"
        "def h(cfg: int, hf_config: Optional[Any], *args: Any, **model_config: Any): ...\n"
        "def k(options: dict[str, Any], peft: PeftSection | None, lora: Any): ..."
    )
    assert any_config_params(source) == ["f(cfg)", "g(section)", "h(hf_config)", "h(model_config)", "k(lora)"]


def _imported_modules(path: Path) -> list[str]:
    """Modules a file imports at run time (TYPE_CHECKING blocks are not run)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append(node.module)
    return out


#: What reads or writes this machine's disk (or imports by name), by module and by method.
IO_MODULES = {"os", "glob", "io", "json", "shutil", "subprocess", "importlib", "tempfile", "mmap"}
IO_CALLS = {
    "open",
    "is_dir",
    "is_file",
    "exists",
    "read_text",
    "read_bytes",
    "stat",
    "iterdir",
    "glob",
    "resolve",
}


#: automodel-data's section modules (and its errors): the dataset sections the config holds live there
DATA_SECTIONS = (
    "automodel.data.text_sections",
    "automodel.data.pretrain_sections",
    "automodel.data.streaming_section",
    "automodel.data.sections",
    "automodel.data.errors",
)


def test_config_package_is_a_leaf_that_reads_no_disk() -> None:
    files = sorted(CONFIG_PACKAGE.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        for module in _imported_modules(path):
            if module.startswith("automodel."):
                assert module.startswith(
                    ("automodel.recipes.config", "automodel.recipes.errors", "automodel.mesh", *DATA_SECTIONS)
                ), f"{path.name} imports {module}"
            assert module.split(".")[0] not in IO_MODULES, f"{path.name} imports {module}"
        tree = ast.parse(path.read_text())
        assert not [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            and n.module == "pathlib"
            and any(a.name == "Path" for a in n.names)
        ], f"{path.name} imports pathlib.Path (PurePath joins names without the disk)"
        calls = {
            n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
            for n in ast.walk(tree)
            if isinstance(n, ast.Call)
        }
        assert not calls & IO_CALLS, f"{path.name} calls {sorted(calls & IO_CALLS)}"


def test_importing_the_config_package_runs_no_other_recipes_module() -> None:
    code = (
        "import sys, automodel.recipes.config.recipe, automodel.data.pretrain_sections, "
        "automodel.data.streaming_section, automodel.recipes.config.hub_datasets\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('automodel.'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    loaded = out.split()
    assert "automodel.recipes.config.recipe" in loaded
    outside = [
        m
        for m in loaded
        if not m.startswith(("automodel.recipes.config", "automodel.mesh", *DATA_SECTIONS))
        and m not in ("automodel.recipes", "automodel.recipes._version", "automodel.recipes.errors")
        and m not in ("automodel.data", "automodel.data._version")
    ]
    assert outside == []


def test_parsing_reads_no_disk_and_the_launch_check_refuses_with_the_old_message(tmp_path: Path) -> None:
    """A missing tokenizer directory, a ``bad_rows: skip`` on a file skip cannot read and a missing
    pipeline schedule CSV parse (the config layer reads no disk); `check_launch` on this machine
    refuses each with the message the section gave before."""
    cfg = load_config(tiny_config(str(tmp_path / "a"), tokenizer={"path": "/nonexistent/tok"}))
    assert cfg.tokenizer.path == "/nonexistent/tok"
    with pytest.raises(ConfigError, match=r"^tokenizer.path='/nonexistent/tok': is not a local directory$"):
        check_launch(cfg, world_size=1, this_machine=True)

    text = tmp_path / "d.txt"
    text.write_text("x\n")
    sft = {
        "source": "instruction",
        "path_or_dataset_id": str(text),
        "column_mapping": {"question": "q", "answer": "a"},
        "bad_rows": "skip",
    }
    raw = tiny_config(str(tmp_path / "b"))
    raw["dataset"] = sft
    cfg = load_config(raw)
    with pytest.raises(
        ConfigError,
        match=r"^dataset.bad_rows='skip': applies to .jsonl, .json, .csv, .parquet files, not .*d.txt$",
    ):
        check_launch(cfg, world_size=1, this_machine=True)

    missing = "/nonexistent/schedule.csv"  # automodel.pipeline's PipelineConfig reads no disk either
    pipeline = {"pp_size": 2, "pipeline": {"pp_schedule_csv": missing}}
    cfg = load_config(tiny_config(str(tmp_path / "c"), distributed=pipeline))
    assert cfg.distributed.pipeline_config is not None
    assert cfg.distributed.pipeline_config.pp_schedule_csv == missing
    with pytest.raises(
        ConfigError,
        match=rf"^distributed.pipeline.pp_schedule_csv='{missing}': pp_schedule_csv='{missing}' does not exist",
    ):
        check_launch(cfg, world_size=2, this_machine=True)


def test_machine_defaults_and_resolution_give_new_values(tmp_path: Path) -> None:
    """Nothing assigns to a built config: resolving a section returns a new one."""
    from automodel.recipes._dist_setup import resolve_machine_defaults

    cfg = load_config(tiny_config(str(tmp_path)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tokenizer.path = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.distributed.strategy_config.backend = "x"  # type: ignore[misc]
    before = cfg.distributed.strategy_config
    resolved = resolve_machine_defaults(cfg.distributed, cuda=False)
    assert resolved is not cfg.distributed and cfg.distributed.strategy_config is before
    assert isinstance(resolved.strategy_config, StrategyConfig)


def test_strategy_configs_answer_the_cross_cutting_facts_typed() -> None:
    """Every strategy's config is a `StrategyConfig`: compute / reduce dtypes and the per-layer
    flags are attributes, the same on every strategy (no getattr with a default); TP's options are
    not a strategy's (the tp parallelism's `TensorParallelConfig`)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from automodel.fsdp2 import DDPConfig, FSDP2Config
    from automodel.megatron_fsdp.config import MegatronFSDPConfig

    for name in strategy_names():
        strategy = get_strategy(name)
        config_class = strategy.config_class()
        assert issubclass(config_class, StrategyConfig), name
        assert config_class.LAYER_FLAGS == strategy.layer_flags, name
    fsdp2 = FSDP2Config(
        sequence_parallel=True,
        activation_checkpointing=True,
        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    assert fsdp2.enabled_layer_flags == ("activation_checkpointing",)
    assert (fsdp2.compute_dtype, fsdp2.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp2.tensor_parallel.sequence_parallel  # the package's own users keep NeMo's fields
    ddp = DDPConfig()
    assert (ddp.compute_dtype, ddp.reduce_dtype, ddp.enabled_layer_flags) == (None, None, ())
    assert not hasattr(StrategyConfig(), "sequence_parallel_enabled")
    assert not hasattr(StrategyConfig(), "custom_tp_plan")
    assert MegatronFSDPConfig(grad_reduce_in_fp32=True).reduce_dtype == torch.float32
    # facts only some strategies have a flag for: a property of the base, a field where they do
    for name in strategy_names():
        config_class = get_strategy(name).config_class()
        assert config_class(backend="gloo").backend == "gloo", name
        assert isinstance(config_class().backend, str), name
    assert StrategyConfig().backend is None
    assert FSDP2Config(patch_is_packed_sequence=True).patch_is_packed_sequence is True
    assert FSDP2Config().patch_is_packed_sequence is False and ddp.patch_is_packed_sequence is False
    assert FSDP2Config(tp_plan="m.plan").tensor_parallel.tp_plan == "m.plan"
    assert MegatronFSDPConfig(tp_plan="m.plan").custom_tp_plan == "m.plan"


def test_no_getattr_reads_a_strategy_config() -> None:
    """What code outside a strategy reads of its config is a typed attribute of `StrategyConfig`."""
    found = [
        f"{p.relative_to(REPO)}:{n.lineno}"
        for p in SRC.rglob("*.py")
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.Call)
        and getattr(n.func, "id", None) == "getattr"
        and n.args
        and "strategy_config" in ast.unparse(n.args[0])
    ]
    assert found == []
