"""Pages of docs/ that must follow the code or the rules of issue 32.

docs/benchmarks.md: every table of figures names the command that produced it and the
machine it ran on (no figure in the manual without its command).
docs/reference/schema.md: it includes every migration file, so a new one appears.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"


def sections_without_their_command(markdown: str) -> list[str]:
    """Titles of the ``##`` sections that hold a table but no ``outbox bench`` command
    or no machine ("quiet machine", "slower machine", "2-core machine")."""
    missing = []
    for section in re.split(r"^## ", markdown, flags=re.M)[1:]:
        title, _, body = section.partition("\n")
        if not re.search(r"^\|", body, re.M):
            continue
        has_command = re.search(r"`outbox bench[^`]*`", body)
        has_machine = re.search(r"(quiet|slower|2-core) machine", body)
        if not (has_command and has_machine):
            missing.append(title)
    return missing


def test_benchmarks__every_table_has_its_command_and_machine() -> None:
    text = PAGE.read_text()
    assert text.count("\n## ") >= 6
    assert sections_without_their_command(text) == []


def test_benchmarks__a_table_without_a_command_is_found() -> None:
    page = (
        "# B\n\n## Measured\n\n| a |\n|---|\n| 1 |\n\n"
        "## Run\n\n`outbox bench` on the quiet machine\n\n| b |\n"
    )
    assert sections_without_their_command(page) == ["Measured"]


def test_schema_page__includes_every_migration() -> None:
    page = (ROOT / "docs" / "reference" / "schema.md").read_text()
    included = set(re.findall(r'^--8<-- "outbox/db/schema/([^"]+)"$', page, re.M))
    migrations = {path.name for path in (ROOT / "outbox" / "db" / "schema").glob("*.sql")}
    assert migrations and included == migrations
