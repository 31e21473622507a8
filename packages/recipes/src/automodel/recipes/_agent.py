"""torchrun's agent as started by the `recipes train` launcher (``python -m automodel.recipes._agent``).

It is torch's own launcher (``torch.distributed.run.main``) with three differences:

- it dies with the launcher (parent-death signal), and tells each rank to die with it;
- its own messages (log lines, the ``ChildFailedError`` dump) go to ``--log`` instead of the
  terminal, which keeps the ranks' output: the launcher prints one line per failure from the
  ranks' reports, and this log's tail only when no rank explained itself;
- it passes its pid to the ranks (``--launcher-pid``), so each rank checks that its parent-death
  signal is tied to this process.

Usage: ``python -m automodel.recipes._agent --parent PID --log FILE -- <torchrun arguments>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from automodel.recipes.lifetime import die_with_parent


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="automodel.recipes._agent")
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)

    die_with_parent(expected_parent=args.parent)
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
    except BaseException:
        traceback.print_exc(file=log)
        return 1
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
