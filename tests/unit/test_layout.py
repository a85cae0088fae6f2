"""The package layout's rules (docs/development.md), beside lint-imports' layers.

- No import cycle between modules, counting imports inside functions and under
  ``TYPE_CHECKING`` (a cycle hidden there is still a cycle for the reader).
- No private name (``_x``) imported across modules.
- Each subpackage's ``__init__`` says what it owns and what it may import.
- The layer contract itself (``pyproject.toml``) holds, run through import-linter.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("outbox", "resolver")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_layout__no_import_cycles() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    assert import_cycles(graph) == []


def test_layout__cycle_finder_sees_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert import_cycles(graph) == [["a.x", "a.y"]]


def private_imports(source: str, name: str) -> list[str]:
    """``from outbox.m import _name``: a private name crossing a module boundary."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name}:{node.lineno} {alias.name}")
    return found


def test_layout__no_private_name_crosses_a_module() -> None:
    hits = [
        hit
        for path in _sources()
        for hit in private_imports(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert hits == []


def test_layout__private_import_finder_sees_one() -> None:
    source = "from outbox.db.session import _hidden, shown\nfrom os import _exit\n"
    assert private_imports(source, "bad.py") == ["bad.py:1 _hidden"]


@pytest.mark.parametrize(
    "package",
    sorted(
        str(p.parent.relative_to(ROOT))
        for p in (ROOT / "outbox").glob("*/__init__.py")
        if p.parent.name != "__pycache__"
    ),
)
def test_layout__each_package_says_what_it_owns_and_may_import(package: str) -> None:
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    assert doc, f"{package}/__init__.py has no docstring"
    assert "May import" in doc, f"{package}/__init__.py does not say what it may import"


def test_layout__layers_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout[-3000:]
