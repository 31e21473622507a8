"""An instruction set every machine with Python has: standard-library function -> its summary line.

Each example asks for a public function of a pure-Python standard-library module by its signature
(``question``: ``textwrap.dedent(text)``) and answers with the first line of its docstring
(``answer``: ``Remove any common leading whitespace from every line in `text`.``), read at run time
with `inspect`. The list is sorted, so one Python version always yields the same examples; every
20th is held out as the validation split. Used by ``dataset.source: stdlib_docstrings``.
"""

from __future__ import annotations

import importlib
import inspect
import warnings

_HOLDOUT_EVERY = 20

#: Pure-Python modules with documented public functions (no GUI, no side effects on import).
MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "codecs", "colorsys", "copy", "csv", "dataclasses",
    "datetime", "difflib", "dis", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib",
    "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.cookies",
    "imaplib", "inspect", "ipaddress", "json", "keyword", "linecache", "locale", "logging", "mimetypes",
    "ntpath", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform",
    "plistlib", "poplib", "posixpath", "pprint", "py_compile", "queue", "quopri", "random", "re",
    "reprlib", "sched", "secrets", "shlex", "shutil", "site", "smtplib", "socket", "ssl", "stat",
    "statistics", "string", "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "threading",
    "tokenize", "traceback", "types", "typing", "urllib.parse", "urllib.request", "uu", "uuid",
    "warnings", "wave", "weakref", "zipfile",
)  # fmt: skip


def _functions() -> list[tuple[str, str, str]]:
    """(module.name, signature, first docstring line) of every documented public function."""
    out: dict[str, tuple[str, str, str]] = {}
    for module_name in MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, obj in vars(module).items():
            if name.startswith("_") or not inspect.isfunction(obj) or obj.__module__ != module.__name__:
                continue
            doc = inspect.getdoc(obj)
            summary = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
            if len(summary) < 8:
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            qualified = f"{module_name}.{name}"
            out[qualified] = (qualified, signature, summary)
    return [out[k] for k in sorted(out)]


def stdlib_docstring_examples(*, split: str = "train") -> list[dict[str, str]]:
    """``{"question": "module.function(signature)", "answer": "first docstring line"}`` records."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    records = []
    for i, (qualified, signature, summary) in enumerate(_functions()):
        if (i % _HOLDOUT_EVERY == _HOLDOUT_EVERY - 1) != (split == "validation"):
            continue
        records.append({"question": f"{qualified}{signature}", "answer": summary})
    return records
