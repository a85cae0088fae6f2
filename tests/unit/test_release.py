"""The package version moves with the schema, and the changelog and deploy files follow."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from outbox.cli import cli
from outbox.db import migrate
from tests.fixtures.pyproject import pyproject
from tests.fixtures.releases import RELEASES

ROOT = Path(__file__).resolve().parents[2]


def version_of(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def package_version() -> str:
    """The version, read from the one file that writes it (as setuptools reads it)."""
    text = (ROOT / "outbox" / "_version.py").read_text()
    match = re.search(r'^__version__ = "([0-9.]+)"$', text, re.M)
    assert match, "outbox/_version.py has no version"
    return match.group(1)


def test_release__version_is_newer_than_every_release_and_moves_with_the_schema() -> None:
    current = version_of(package_version())
    last = RELEASES[-1]
    assert current > version_of(last.version)
    if last.schema < migrate.LATEST_VERSION:
        # A schema change is a minor release at least (0.x: an upgrade must know).
        assert current[:2] > version_of(last.version)[:2], (current, last)


def test_release__changelog_has_the_version_and_every_release_with_its_schema() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert f"## {package_version()} " in changelog
    for release in RELEASES:
        row = f"| {release.version} | {release.schema} | `{release.commit[:7]}` |"
        assert row in changelog, row
        assert f"## {release.version} (schema {release.schema}, commit" in changelog


def test_release__deploy_files_run_this_version() -> None:
    tags = {
        (path.name, tag)
        for path in (ROOT / "deploy").rglob("*")
        if path.is_file()
        for tag in re.findall(r"outbox-relay:([0-9][0-9.]*[0-9])", path.read_text(errors="ignore"))
    }
    assert tags and {tag for _, tag in tags} == {package_version()}, sorted(tags)


def test_release__the_package_says_its_version() -> None:
    import outbox

    assert outbox.__version__ == package_version()


def test_release__the_version_is_written_once() -> None:
    project = pyproject()
    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "outbox._version.__version__"
    written = [
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / "outbox").rglob("*.py")
        if re.search(r"^__version__ = ", path.read_text(), re.M)
    ]
    assert written == ["outbox/_version.py"]


def test_release__the_command_says_its_version() -> None:
    result = CliRunner().invoke(cli, ["--version"], prog_name="outbox")
    assert result.exit_code == 0
    assert result.output == f"outbox, version {package_version()}\n"
