"""``outbox web`` without the ``web`` extra says what to install (exit 2)."""

from __future__ import annotations

import subprocess
import sys

# The console's libraries made unimportable, as in an install without the extra.
WITHOUT_THE_EXTRA = """
import sys
sys.modules["starlette"] = None
from outbox.cli import main
main(["web"])
"""


def test_web__without_the_web_extra_exits_2_with_the_install_hint() -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_EXTRA], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "error: outbox web needs the console's libraries: starlette is not installed",
        "  hint: install the web extra: pip install 'outbox-relay[web]'",
    ]
