"""The enqueue API is declared once (``outbox.enqueue``); the SQLAlchemy and Django
integrations adapt it, so their signatures cannot drift from it."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import subprocess
import sys
from types import ModuleType

import pytest

from outbox.enqueue import OutgoingMessage

# The public keywords of ``outbox.enqueue`` as users call them (a change here is a
# change of the public API: say so in CHANGELOG.md).
MESSAGE = [
    "exchange",
    "routing_key",
    "payload",
    "headers",
    "content_type",
    "message_id",
    "ordering_key",
    "deliver_at",
    "delay",
]
JSON = [
    "exchange",
    "routing_key",
    "body",
    "headers",
    "message_id",
    "ordering_key",
    "deliver_at",
    "delay",
]


def module(name: str) -> ModuleType:
    # ``outbox.enqueue`` the attribute is the function: go by the module's name.
    return importlib.import_module(name)


def keywords(function: object) -> list[inspect.Parameter]:
    return [
        p
        for p in inspect.signature(function).parameters.values()  # type: ignore[arg-type]
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]


def names(function: object) -> list[str]:
    return [p.name for p in keywords(function)]


def test_enqueue__keywords_are_the_outgoing_messages_fields() -> None:
    core = module("outbox.enqueue")
    assert [f.name for f in dataclasses.fields(OutgoingMessage)] == MESSAGE
    for name in ("enqueue", "enqueue_async"):
        assert names(getattr(core, name)) == [*MESSAGE, "table"]
    for name in ("enqueue_json", "enqueue_json_async"):
        assert names(getattr(core, name)) == [*JSON, "table"]
    for name in ("enqueue_many", "enqueue_many_async"):
        assert names(getattr(core, name)) == ["table"]


@pytest.mark.parametrize("integration", ["sqlalchemy", "django"])
def test_enqueue__integrations_take_what_outbox_enqueue_takes(integration: str) -> None:
    core = module("outbox.enqueue")
    adapter = module(f"outbox.integrations.{integration}")
    functions = [name for name in adapter.__all__ if name.startswith("enqueue")]
    assert functions == sorted(
        name
        for name in dir(core)
        if name.startswith("enqueue") and (integration != "django" or "async" not in name)
    )
    for name in functions:
        theirs, ours = getattr(adapter, name), getattr(core, name)
        assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(ours), name
        expected = keywords(ours)
        if integration == "django":  # settings.OUTBOX_TABLE by default, and the database
            table = inspect.Parameter(
                "table", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None"
            )
            expected = [table if p.name == "table" else p for p in expected]
            expected.append(
                inspect.Parameter(
                    "using",
                    inspect.Parameter.KEYWORD_ONLY,
                    default="default",
                    annotation="str",
                )
            )
        assert keywords(theirs) == expected, name
        assert inspect.signature(theirs).return_annotation == (
            inspect.signature(ours).return_annotation
        )


@pytest.mark.parametrize(
    "first",
    [
        "import outbox",
        "import outbox.enqueue",
        "from outbox.enqueue import enqueue",
        "import outbox.cli",
        "from outbox import enqueue_many",
    ],
)
def test_outbox_enqueue__is_the_function_whatever_was_imported_first(first: str) -> None:
    """``import outbox`` loads the API on first use (the command's entry point runs
    before the drivers load); ``outbox.enqueue`` stays the function though its
    submodule, loaded later, has the same name.  In a fresh interpreter: the order of
    imports decides."""
    code = (
        f"{first}\nimport sys, outbox\n"
        "assert callable(outbox.enqueue), outbox.enqueue\n"
        "from outbox import enqueue, OutgoingMessage\n"
        "assert enqueue is outbox.enqueue and enqueue.__module__ == 'outbox.enqueue'\n"
        "assert callable(outbox.enqueue)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_import_outbox__loads_no_driver() -> None:
    code = (
        "import sys, outbox\n"
        "print(sorted(m for m in ('psycopg', 'click', 'pika', 'kombu') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)
