"""README.md stays a short overview whose every link resolves (issue 32).

The manual is docs/ (built strictly by tests/acceptance/test_docs_site.py); GitHub
and PyPI show README.md on its own, outside that build, so its links are checked
here: each relative link names an existing file, and an anchor names a heading of
that file.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def headings_anchors(markdown: str) -> set[str]:
    """The anchors of a Markdown file's headings, as GitHub and MkDocs make them."""
    anchors = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            text = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower())
            anchors.add(text.replace(" ", "-"))
    anchors.update(re.findall(r'<a id="([^"]+)"', markdown))
    return anchors


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:: not checked offline
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in headings_anchors(file.read_text()):
            broken.append(f"{target}: no heading with that anchor")
    return broken


def fenced_blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, re.S | re.M)


def test_readme__is_short() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_readme__every_relative_link_resolves() -> None:
    links = LINK.findall(README.read_text())
    assert any(link.startswith("docs/") for link in links)
    assert broken_links(README) == []


def test_readme__quick_start_is_the_tutorials() -> None:
    quickstart = (ROOT / "docs" / "tutorial" / "quickstart.md").read_text()
    commands = fenced_blocks(README.read_text(), "sh")[0]
    assert commands in fenced_blocks(quickstart, "sh")
    for command in ("outbox demo ", "outbox demo --consume", "pytest "):
        assert command in commands


def test_readme__the_link_check_finds_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](other.md#a-section) [gone](missing.md) [bad](other.md#nowhere) [web](https://x)"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading with that anchor",
    ]
