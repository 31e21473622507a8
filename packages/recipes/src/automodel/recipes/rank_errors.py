"""Errors raised inside the ranks of `recipes train`, reported as one line instead of a torchrun dump.

A rank that fails writes its full traceback to ``<output_dir>/logs/rank_<N>.error.log`` (or, when
output_dir cannot be written, next to its report) and, under the `recipes` launcher, a small JSON
report into the launcher's error directory. The launcher reads the reports once torchrun is done:
user mistakes (config, data, checkpoint, file-system errors, a rendezvous port in use, and every
`ValueError` the project raises on purpose: `errors.is_user_error`) become one line each and exit
code 2; a run failure with a clear cause (non-finite loss, collective time-out, another node that
stopped: `automodel.recipes.node_watch`) one line and exit 1; any
other error the root-cause rank's traceback (the earliest failure) and exit 1.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from automodel.mesh import RendezvousError
from automodel.recipes.checkpoint.paths import CheckpointError
from automodel.recipes.errors import ConfigError, DataError, is_user_error
from automodel.recipes.file_kind import os_error_line
from automodel.recipes.node_watch import NodeStoppedError
from automodel.recipes.trainer import CollectiveTimeoutError, NonFiniteError

EXIT_USER_ERROR = 2
EXIT_RUN_ERROR = 1

#: File-system errors that are the user's environment, not a bug: one line naming the file.
USER_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EISDIR,
     errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.EMFILE, errno.EIO}
)  # fmt: skip


@dataclass(frozen=True)
class RankReport:
    """What one failed rank tells the launcher."""

    rank: int
    exit_code: int
    line: str  # the one line to print ("" for an internal error: print the traceback)
    error: str  # "Type: message" of the exception
    traceback_file: str
    time: float


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc`, its causes and contexts, and the per-rank failures a DCP CheckpointException wraps."""
    seen: list[BaseException] = []
    stack = [exc]
    while stack:
        e = stack.pop(0)
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        stack += [e.__cause__, e.__context__]  # type: ignore[list-item]
    return seen


def classify(exc: BaseException) -> tuple[int, str]:
    """``(exit code, one line)`` for `exc`; the line is "" when only a traceback explains it."""
    chain = _causes(exc)
    for e in chain:
        if isinstance(e, ConfigError | DataError | RendezvousError):
            return EXIT_USER_ERROR, str(e)
    for e in chain:
        if isinstance(e, OSError) and e.errno in USER_ERRNOS:
            return EXIT_USER_ERROR, os_error_line(e)
    for e in chain:
        if isinstance(e, CheckpointError):
            return EXIT_USER_ERROR, str(e)
    for e in chain:  # after the file and checkpoint errors, whose lines name the file
        if is_user_error(e):
            return EXIT_USER_ERROR, str(e)

    if isinstance(exc, NonFiniteError | CollectiveTimeoutError | NodeStoppedError):
        return EXIT_RUN_ERROR, f"{type(exc).__name__}: {exc}"
    return EXIT_RUN_ERROR, ""


def write_traceback(exc: BaseException, *, rank: int, output_dir: str | None, fallback_dir: Path) -> Path:
    """The full traceback in ``<output_dir>/logs/rank_<N>.error.log``, else under `fallback_dir`."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    name = f"rank_{rank}.error.log"
    candidates = [Path(output_dir) / "logs" / name] if output_dir else []
    candidates.append(fallback_dir / name)
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            return path
        except OSError:
            continue
    return Path("<not written>")


def report_failure(
    exc: BaseException, *, rank: int, output_dir: str | None, error_dir: str | None
) -> RankReport:
    """Write this rank's traceback (and, under the launcher, its report); return the report."""
    code, line = classify(exc)
    fallback = Path(error_dir) if error_dir else Path(tempfile.gettempdir())
    tb_file = write_traceback(exc, rank=rank, output_dir=output_dir, fallback_dir=fallback)
    report = RankReport(
        rank=rank,
        exit_code=code,
        line=line,
        error=f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
        traceback_file=str(tb_file),
        time=time.time(),
    )
    if error_dir:
        try:
            tmp = Path(error_dir) / f".rank_{rank}.json.tmp"
            tmp.write_text(json.dumps(asdict(report)))
            os.replace(tmp, Path(error_dir) / f"rank_{rank}.json")
        except OSError:
            pass  # the launcher then prints torchrun's own summary; the rank's stderr line stays
    return report


def read_reports(error_dir: str | Path) -> list[RankReport]:
    """Every rank's report, earliest failure first."""
    reports = []
    for path in sorted(Path(error_dir).glob("rank_*.json")):
        try:
            reports.append(RankReport(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(reports, key=lambda r: r.time)


def summarize(reports: list[RankReport]) -> tuple[int, list[str]]:
    """``(exit code, lines to print)`` for the failed ranks' reports (see the module docstring).

    A user mistake on any rank explains the others' failures (a peer that left a collective),
    so the one-line errors win; each distinct line is printed once, with the ranks that hit it.
    """
    one_line = [r for r in reports if r.line]
    if one_line:
        user = [r for r in one_line if r.exit_code == EXIT_USER_ERROR]
        chosen, code = (user, EXIT_USER_ERROR) if user else (one_line, EXIT_RUN_ERROR)
        by_line: dict[str, list[RankReport]] = {}
        for r in chosen:
            by_line.setdefault(r.line, []).append(r)
        lines = []
        for line, rs in by_line.items():
            ranks = ", ".join(str(r.rank) for r in sorted(rs, key=lambda r: r.rank))
            lines.append(f"error: {line}")
            lines.append(f"  (rank {ranks}; full traceback: {rs[0].traceback_file})")
        return code, lines
    root = reports[0]
    try:
        text = Path(root.traceback_file).read_text().rstrip()
    except OSError:
        text = root.error
    lines = [f"rank {root.rank} failed first:", text]
    for r in reports[1:]:
        lines.append(f"rank {r.rank} then failed: {r.error} (traceback: {r.traceback_file})")
    return EXIT_RUN_ERROR, lines


def print_lines(lines: list[str]) -> None:
    print("\n".join(lines), file=sys.stderr, flush=True)
