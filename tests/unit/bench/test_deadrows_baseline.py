"""The dead-rows benchmark's baseline claim (``CLAIM_0_5``) is 0.5.0's, to the letter.

The benchmark runs from an installed package, without this repository's history,
so it keeps its own copy of the statement it compares with; this test reads the
statement from the commit that shipped 0.5.0 (``tests/fixtures/releases.py``), so
the copy cannot drift from what 0.5.0 ran."""

from __future__ import annotations

import re
import subprocess

import pytest

from outbox.bench.deadrows import CLAIM_0_5
from tests.fixtures.releases import REPOSITORY, release

BLOCK = re.compile(r"^-- ([a-z_]+) --$", re.MULTILINE)


def released_statement(version: str, name: str) -> str:
    """Statement ``name`` of ``queries.sql`` as release ``version`` shipped it, its
    comments left out as ``outbox.db.queries`` leaves them out."""
    shown = subprocess.run(
        ["git", "show", f"{release(version).commit}:outbox/db/queries.sql"],
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        pytest.skip(f"no history of the repository to read 0.5.0 from: {shown.stderr.strip()}")
    parts = BLOCK.split(shown.stdout)
    body = dict(zip(parts[1::2], parts[2::2], strict=False))[name]
    lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
    return "\n".join(lines).strip()


def test_deadrows__the_baseline_claim_is_the_one_0_5_0_shipped() -> None:
    assert CLAIM_0_5.strip() == released_statement("0.5.0", "claim_batch")
