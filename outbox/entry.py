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
import json
import os
import signal
import sys
import time
from types import FrameType

# 128 + SIGINT, as shells report a command ended by Ctrl-C (errors.ExitCode.INTERRUPTED).
INTERRUPTED = 130


def _interrupted(when: str) -> None:
    """Say so as ``cli.main`` would (``cli.common.report_error``: one line, or one JSON
    object with ``--log-format json`` or ``OUTBOX_LOG_FORMAT=json``), then exit 130.
    Nothing of ``outbox`` is imported here: the interrupt may have come in the middle
    of importing it."""
    message = f"interrupted (Ctrl-C) {when}"
    hint = "nothing was done; run the command again"
    args = sys.argv[1:]
    as_json = (
        any(
            a == "--log-format=json" or (a == "--log-format" and args[i + 1 : i + 2] == ["json"])
            for i, a in enumerate(args)
        )
        or os.environ.get("OUTBOX_LOG_FORMAT", "").strip().lower() == "json"
    )
    if as_json:
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        entry = {
            "ts": f"{stamp}.{int(now % 1 * 1000):03d}+00:00",
            "level": "error",
            "logger": "outbox.cli",
            "event": "cli.error",
            "error": message,
            "hint": hint,
            "exit_code": INTERRUPTED,
        }
        sys.stderr.write(json.dumps(entry) + "\n")
    else:
        sys.stderr.write(f"error: {message}\n  hint: {hint}\n")
    sys.stderr.flush()


def _while_loading(signum: int, frame: FrameType | None) -> None:
    _interrupted("before the command started")
    raise SystemExit(INTERRUPTED)


# Imported outside the main thread, it is not the command: nothing to install.
with contextlib.suppress(ValueError):
    signal.signal(signal.SIGINT, _while_loading)


def main() -> None:
    from outbox.cli import main as run

    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        run()  # reports an interrupt itself, from its first line on
    except KeyboardInterrupt:  # the moment between the two lines above
        _interrupted("before the command started")
        sys.exit(INTERRUPTED)
