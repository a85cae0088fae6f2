"""Every reference from the code to the manual leads to a heading of it (issue 32).

Error hints, docstrings and comments cite the manual by its path in the repository,
``docs/reference/privileges.md`` or ``docs/how-to/clusters.md#tls``-style with an
anchor, so that a user can follow one from an error message.  Each must name a page
of the site (mkdocs.yml's nav) and, with an anchor, a heading of that page, by the id
MkDocs gives it: the page is rendered with mkdocs.yml's own Markdown extensions (the
toc extension's default slugify, attr_list's ``{ #id }``, the CLI sections mkdocs-click
generates, a repeated heading suffixed ``_1``).  Anchors that plugins add to the built
HTML (mkdocstrings' API entries) are not known here; a strict build checks the pages'
own links (tests/acceptance/test_docs_site.py), this test the code's.

README.md became a short overview and its sections moved to docs/: nothing may cite
a section of the README any more ("README, 'Privileges'"), only README.md itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import markdown
import pytest
from mkdocs.config import load_config

ROOT = Path(__file__).resolve().parents[2]
# Where the code, its hints and its comments live.
SCANNED = ("outbox", "resolver", "deploy", "tests", ".ci", "pyproject.toml")
# This file's own examples of broken references are written to a temporary project.
THIS_FILE = Path(__file__).resolve()
# The test of README.md itself names it as a variable (``README = ROOT / ...``).
README_TEST = ROOT / "tests" / "unit" / "test_readme.py"

DOCS_REFERENCE = re.compile(r"\bdocs/[\w./-]*?\.md(?:#[\w.-]+)?")
# "README" other than "README.md", or README.md followed by a section: an anchor,
# ", 'Privileges'" or "'s "Upgrading"".
README_SECTION = re.compile(r"""\bREADME\b(?!\.md\b)|\bREADME\.md(?:#|,\s*["'“]|'s\s+["'“])""")


def scanned_files(root: Path, skip: Sequence[Path] = ()) -> Iterator[tuple[Path, str]]:
    for name in SCANNED:
        top = root / name
        for path in sorted([top] if top.is_file() else top.rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path in skip:
                continue
            try:
                yield path, path.read_text()
            except UnicodeDecodeError:
                continue  # images, archives


def docs_references(root: Path) -> Iterator[tuple[str, str]]:
    """(``file:line``, reference) of every ``docs/….md[#anchor]`` under SCANNED."""
    for path, text in scanned_files(root, skip=[THIS_FILE]):
        for number, line in enumerate(text.splitlines(), 1):
            for match in DOCS_REFERENCE.finditer(line):
                where = f"{path.relative_to(root)}:{number}"
                yield where, match.group().rstrip(".")


def nav_pages(nav: Any) -> Iterator[str]:
    """The page paths of mkdocs.yml's nav (nested lists of ``{title: page}``)."""
    if isinstance(nav, str):
        yield nav
    elif isinstance(nav, list):
        for item in nav:
            yield from nav_pages(item)
    elif isinstance(nav, dict):
        for value in nav.values():
            yield from nav_pages(value)


class Site:
    """The pages of a MkDocs project and their headings' ids, as MkDocs makes them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.config = load_config(str(root / "mkdocs.yml"))
        self.pages = set(nav_pages(self.config.nav))
        self._headings: dict[str, set[str]] = {}

    def headings(self, page: str) -> set[str]:
        if page not in self._headings:
            md = markdown.Markdown(
                extensions=self.config.markdown_extensions,
                extension_configs=self.config.mdx_configs,
            )
            # Snippets' base_path is relative to where mkdocs runs: the project's root.
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(self.root)
                md.convert((Path(self.config.docs_dir) / page).read_text())
            self._headings[page] = set(heading_ids(md.toc_tokens))
        return self._headings[page]


def heading_ids(tokens: list[dict[str, Any]]) -> Iterator[str]:
    for token in tokens:
        yield token["id"]
        yield from heading_ids(token["children"])


def broken_references(root: Path) -> list[str]:
    site = Site(root)
    broken = []
    for where, reference in docs_references(root):
        path, _, anchor = reference.partition("#")
        page = path.removeprefix("docs/")
        if page not in site.pages:
            broken.append(f"{where}: {reference}: no such page in mkdocs.yml's nav")
        elif anchor and anchor not in site.headings(page):
            broken.append(f"{where}: {reference}: no heading with that anchor")
    return broken


def readme_sections_cited(root: Path) -> list[str]:
    cited = []
    for path, text in scanned_files(root, skip=[THIS_FILE, README_TEST]):
        for number, line in enumerate(text.splitlines(), 1):
            if README_SECTION.search(line):
                cited.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return cited


@pytest.fixture(scope="session")
def broken() -> list[str]:
    return broken_references(ROOT)


def test_docs_references__every_page_and_anchor_exists(broken: list[str]) -> None:
    assert broken == []


def test_docs_references__the_error_hints_are_among_those_checked() -> None:
    found = {where.partition(":")[0] for where, _ in docs_references(ROOT)}
    for hint in ("outbox/db/session.py", "outbox/db/migrate.py", "outbox/ops/status.py"):
        assert hint in found, f"{hint} cites no page of docs/"


def test_docs_references__no_code_cites_a_section_of_the_readme() -> None:
    assert readme_sections_cited(ROOT) == []


def test_docs_references__the_checks_find_what_is_broken(tmp_path: Path) -> None:
    (tmp_path / "mkdocs.yml").write_text(
        "site_name: t\nmarkdown_extensions: [attr_list]\nnav: [index.md, {How: how.md}]\n"
    )
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Home\n")
    (tmp_path / "docs" / "how.md").write_text(
        "# How it's done\n\n## TLS, and 2,000 commits/s\n\n## Own { #mine }\n\n"
        "```\n## not a heading\n```\n\n## TLS, and 2,000 commits/s\n"
    )
    (tmp_path / "outbox").mkdir()
    (tmp_path / "outbox" / "hints.py").write_text(
        "ok = 'see docs/how.md#tls-and-2000-commitss, docs/how.md#mine, docs/index.md.'\n"
        "ok = 'docs/how.md#tls-and-2000-commitss_1 docs/how.md#how-its-done'\n"
        "gone = 'docs/nowhere.md docs/how.md#not-a-heading docs/how.md#own'\n"
        "old = \"grant the privileges listed in README.md, 'Privileges'\"\n"
        "fine = 'README.md'\n"
    )
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "compose.yaml").write_text(
        '# On clusters (README, "Running on clusters")\n# COPY README.md ./\n'
    )
    assert broken_references(tmp_path) == [
        "outbox/hints.py:3: docs/nowhere.md: no such page in mkdocs.yml's nav",
        "outbox/hints.py:3: docs/how.md#not-a-heading: no heading with that anchor",
        "outbox/hints.py:3: docs/how.md#own: no heading with that anchor",
    ]
    assert readme_sections_cited(tmp_path) == [
        "outbox/hints.py:4: old = \"grant the privileges listed in README.md, 'Privileges'\"",
        'deploy/compose.yaml:1: # On clusters (README, "Running on clusters")',
    ]
