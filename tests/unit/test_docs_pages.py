"""Pages of docs/ that must follow the code or the rules of issue 32.

docs/benchmarks.md: every table of figures names the command that produced it and the
machine it ran on (no figure in the manual without its command).
docs/explanation/, docs/how-to/: a passage that says it measured something names the
command that did (or links to docs/benchmarks.md), in it or right next to it.  Only
what calls itself measured is found: a figure stated without the word is for review.
docs/reference/schema.md: it includes every migration file, so a new one appears.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


GUIDES = sorted(
    [*(ROOT / "docs" / "explanation").glob("*.md"), *(ROOT / "docs" / "how-to").glob("*.md")]
)
# Says it measured something (the words the pages use for a figure from a run).
MEASURED = re.compile(r"\b(measured|in (?:our|one|two|three|four) runs?)\b", re.I)
# A command that reproduces it, or the benchmarks page that has the command.
COMMAND = re.compile(r"`(?:outbox bench|pytest|python -m)\b[^`]*`|benchmarks\.md")


def measured_without_command(markdown: str) -> list[str]:
    """The first words of each passage (paragraph, list item, table) that says it
    measured something with no command or link to benchmarks.md in it or in the
    passage just before or after it (a table under its "Measured with …")."""
    text = re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S)
    blocks = [b for b in re.split(r"\n\s*\n|\n(?=\s*[*-] )", text) if b.strip()]
    missing = []
    for i, block in enumerate(blocks):
        near = "\n".join(blocks[max(0, i - 1) : i + 2])
        if MEASURED.search(block) and not COMMAND.search(near):
            missing.append(" ".join(block.split())[:80])
    return missing


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_guides__every_measured_figure_has_its_command(page: Path) -> None:
    assert measured_without_command(page.read_text()) == []


def test_guides__a_measured_figure_without_its_command_is_found() -> None:
    page = (
        "# G\n\nWe measured 50 s for one claim.\n\nNothing here.\n\n"
        "* a list item measured 3 ms (`pytest tests/x.py -s`)\n"
        "* and one that is not\n\n"
        "Measured with `outbox bench --horizon`:\n\n| a |\n|---|\n| measured 1 |\n\n"
        "```\nmeasured inside a code block\n```\n"
    )
    assert measured_without_command(page) == ["We measured 50 s for one claim."]


def test_schema_page__includes_every_migration() -> None:
    page = (ROOT / "docs" / "reference" / "schema.md").read_text()
    included = set(re.findall(r'^--8<-- "outbox/db/schema/([^"]+)"$', page, re.M))
    migrations = {path.name for path in (ROOT / "outbox" / "db" / "schema").glob("*.sql")}
    assert migrations and included == migrations
