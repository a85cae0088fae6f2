"""The ``outbox`` command's entry point (``[project.scripts]``, ``python -m outbox``).

Loading the command line takes a few hundred milliseconds (click, the drivers, every
subcommand).  An operator's Ctrl-C in that time used to end the process with
Python's ``KeyboardInterrupt`` traceback, printed from an import line or from the
script's own first lines: nothing ``cli.main`` could catch, as it was not running
yet.  Importing this module (``import outbox`` before it loads nothing: the package
imports its API on first use) installs a SIGINT handler that ends the process with
one line and exit 130 (``errors.ExitCode.INTERRUPTED``); ``main`` puts Python's own
handler back once the command line is loaded, and from then on ``cli.main`` reports
an interrupt the same way.  Only the command imports this module: an application's
``import outbox`` never touches its signal handlers.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from types import FrameType

# 128 + SIGINT, as shells report a command ended by Ctrl-C (errors.ExitCode.INTERRUPTED).
INTERRUPTED = 130


def _while_loading(signum: int, frame: FrameType | None) -> None:
    sys.stderr.write("error: interrupted (Ctrl-C) before the command started\n")
    raise SystemExit(INTERRUPTED)


# Imported outside the main thread, it is not the command: nothing to install.
with contextlib.suppress(ValueError):
    signal.signal(signal.SIGINT, _while_loading)


def main() -> None:
    from outbox.cli import main as run

    signal.signal(signal.SIGINT, signal.default_int_handler)
    run()
