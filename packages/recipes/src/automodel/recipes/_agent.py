"""torchrun's agent as started by the `recipes train` launcher (``python -m automodel.recipes._agent``).

It is torch's own launcher (``torch.distributed.run.main``) with three differences:

- it dies with the launcher (parent-death signal), and tells each rank to die with it;
- its own messages (log lines, the ``ChildFailedError`` dump) go to ``--log`` instead of the
  terminal, which keeps the ranks' output: the launcher prints one line per failure from the
  ranks' reports, and this log's tail only when no rank explained itself;
- it passes its pid to the ranks (``--launcher-pid``), so each rank checks that its parent-death
  signal is tied to this process.

When it cannot gather the nodes (a rendezvous timeout, node 0 unreachable) it leaves the reason in
``--error-dir`` for the launcher's one line.

Usage: ``python -m automodel.recipes._agent --parent PID --log FILE [--error-dir DIR] -- <torchrun arguments>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback
from pathlib import Path

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.run import main as torchrun_main

from automodel.recipes.lifetime import die_with_parent

AGENT_ERROR_FILE = "agent_rendezvous.txt"
#: The ranks' TORCH_CPP_LOG_LEVEL ("" = unset): the launcher runs the agent itself at FATAL.
AGENT_RANKS_CPP_LOG_LEVEL = "AUTOMODEL_RANKS_TORCH_CPP_LOG_LEVEL"


def write_agent_error(error_dir: str | Path, reason: str) -> None:
    """torchrun's agent could not gather the nodes: its reason (one line) for the launcher."""
    try:
        (Path(error_dir) / AGENT_ERROR_FILE).write_text(
            reason.strip().splitlines()[-1][:400] if reason.strip() else "?"
        )
    except OSError:
        pass  # the launcher then prints the agent's log tail


def read_agent_error(error_dir: str | Path) -> str | None:
    try:
        return (Path(error_dir) / AGENT_ERROR_FILE).read_text()
    except OSError:
        return None


def _is_rendezvous_failure(e: BaseException) -> bool:
    """An error of the agent itself meeting the other nodes (the ranks' failures are ChildFailedError)."""
    return isinstance(e, DistError | RendezvousError | TimeoutError | ConnectionError)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="automodel.recipes._agent")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--error-dir", default=None)
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)

    die_with_parent(expected_parent=args.parent)
    ranks_level = os.environ.pop(AGENT_RANKS_CPP_LOG_LEVEL, None)
    if ranks_level is not None:  # read by this process's torch at import; the ranks get the user's
        if ranks_level:
            os.environ["TORCH_CPP_LOG_LEVEL"] = ranks_level
        else:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
    torchrun_args = list(args.torchrun_args)
    if torchrun_args[:1] == ["--"]:
        torchrun_args = torchrun_args[1:]
    torchrun_args.append(f"--launcher-pid={os.getpid()}")  # the training command ends the list
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
    sys.stderr = log  # Python-level only: fd 2, which the ranks inherit, still is the terminal

    try:
        torchrun_main(torchrun_args)
    except ChildFailedError as e:
        print(e.format_msg(), file=log)
        return 1
    except SignalException as e:
        print(f"agent stopped by {e.sigval.name}", file=log)
        return 128 + int(e.sigval)
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    except BaseException as e:
        traceback.print_exc(file=log)
        if args.error_dir is not None and _is_rendezvous_failure(e):
            write_agent_error(args.error_dir, f"{type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
