"""The package's metadata says what it needs (``pyproject.toml``).

Every distribution that ``outbox/`` and ``resolver/`` import is declared: in the
dependencies, or in the extra of the module that imports it (the console imports
Starlette: ``[web]``); an import that only type checkers run (``if TYPE_CHECKING:``)
needs nothing.  Every requirement a user installs has an upper bound, and the
licence files are the ones the metadata names.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.fixtures.pyproject import pyproject

ROOT = Path(__file__).resolve().parents[2]
PROJECT = pyproject()["project"]
OWN = {"outbox", "resolver"}
# Where an extra's imports may be, by path prefix; everything else imports only the
# dependencies.
EXTRA_OF = {
    "outbox/web/": "web",
    "outbox/integrations/sqlalchemy.py": "sqlalchemy",
    "outbox/integrations/django/": "django",
    "outbox/tracing.py": "opentelemetry",
}
# Extras for the project's own work, not for users: no bound needed, never imported.
DEVELOPMENT_EXTRAS = {"docs", "test"}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def top_level_imports(source: str) -> Iterator[str]:
    """The top-level name of every absolute import a module runs, wherever it is
    (in a function too), except under ``if TYPE_CHECKING:``."""

    def walk(node: ast.AST) -> Iterator[str]:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from walk(child)
            return
        if isinstance(node, ast.Import):
            yield from (alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module.partition(".")[0]
        for child in ast.iter_child_nodes(node):
            yield from walk(child)

    yield from walk(ast.parse(source))


def declared(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def allowed_for(path: str) -> set[str]:
    names = declared(PROJECT["dependencies"])
    for prefix, extra in EXTRA_OF.items():
        if path.startswith(prefix):
            names |= declared(PROJECT["optional-dependencies"][extra])
    return names


def undeclared_imports() -> list[str]:
    """``path: module (distributions)`` for each import no declared distribution
    provides."""
    provided_by = importlib.metadata.packages_distributions()
    missing = []
    for path in sorted([*ROOT.glob("outbox/**/*.py"), *ROOT.glob("resolver/**/*.py")]):
        relative = path.relative_to(ROOT).as_posix()
        allowed = allowed_for(relative)
        for module in sorted(set(top_level_imports(path.read_text()))):
            if module in OWN or module in sys.stdlib_module_names or module == "__future__":
                continue
            distributions = {canonicalize_name(d) for d in provided_by.get(module, [])}
            if not distributions & allowed:
                missing.append(f"{relative}: {module} ({', '.join(sorted(distributions))})")
    return missing


def test_packaging__every_imported_distribution_is_declared() -> None:
    assert undeclared_imports() == []


def test_packaging__an_undeclared_import_is_found() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import amqp.spec\n"
        "if TYPE_CHECKING:\n    from typing_extensions import Unpack\n"
        "def f():\n    from anyio import Semaphore\n"
    )
    assert sorted(top_level_imports(source)) == ["amqp", "anyio", "typing"]
    assert "anyio" not in allowed_for("outbox/amqp/consumer.py")
    assert "anyio" in allowed_for("outbox/web/app.py")


USER_REQUIREMENTS = [
    *PROJECT["dependencies"],
    *(
        requirement
        for extra, requirements in PROJECT["optional-dependencies"].items()
        if extra not in DEVELOPMENT_EXTRAS
        for requirement in requirements
    ),
]


@pytest.mark.parametrize("requirement", USER_REQUIREMENTS)
def test_packaging__every_user_requirement_has_both_bounds(requirement: str) -> None:
    operators = {spec.operator for spec in Requirement(requirement).specifier}
    assert ">=" in operators and "<" in operators, requirement


def test_packaging__the_licence_files_are_there_and_named() -> None:
    assert PROJECT["license"] == "Apache-2.0 AND 0BSD"
    assert PROJECT["license-files"] == ["LICENSE", "outbox/web/static/htmx.LICENSE"]
    assert (
        "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()
    )
    assert "Zero-Clause BSD" in (ROOT / "outbox/web/static/htmx.LICENSE").read_text()
    assert "classifiers" in PROJECT and PROJECT["urls"]
