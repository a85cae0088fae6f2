"""The core works without the optional extras, and never imports them on its own.

Each case runs in a fresh interpreter: one where SQLAlchemy, Django and
OpenTelemetry and the web console's Starlette, Jinja2 and uvicorn cannot be imported
(as after a plain ``pip install outbox-relay``),
and one where they are installed but the application never imported them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[3]
EXTRAS = ("sqlalchemy", "django", "opentelemetry", "greenlet", "starlette", "jinja2", "uvicorn")

# Makes every import of an extra fail as if the package were not installed.
BLOCK_EXTRAS = textwrap.dedent(
    f"""
    import importlib.abc, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {EXTRAS!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    """
)

# Imports the whole core, enqueues one row, reports what it saw.
USE_THE_CORE = textwrap.dedent(
    """
    import json, sys
    import psycopg
    import outbox, outbox.cli, outbox.relay.metrics, outbox.ops.status, outbox.tracing
    import resolver.apply

    with psycopg.connect(sys.argv[1]) as conn:
        message_id = outbox.enqueue(conn, exchange="", routing_key="k", payload=b"1",
                                    headers={"tenant": "acme"})
        outbox.enqueue_json(conn, exchange="", routing_key="j", body=[1])

    failures = {}
    for integration in ("sqlalchemy", "django"):
        try:
            __import__(f"outbox.integrations.{integration}")
        except ImportError as exc:
            failures[integration] = str(exc)
    loaded = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[2].split(",")))
    print(json.dumps({"message_id": str(message_id), "failures": failures, "loaded": loaded}))
    """
)


def run(script: str, dsn: str) -> dict[str, object]:
    result = subprocess.run(
        [sys.executable, "-c", script, dsn, ",".join(EXTRAS)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_extras__core_imports_and_enqueues_without_them(dsn: str) -> None:
    report = run(BLOCK_EXTRAS + USE_THE_CORE, dsn)

    assert report["loaded"] == []
    failures = report["failures"]
    assert isinstance(failures, dict)
    assert "pip install 'outbox-relay[sqlalchemy]'" in failures["sqlalchemy"]
    assert "pip install 'outbox-relay[django]'" in failures["django"]
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT message_id::text, headers FROM outbox ORDER BY id").fetchall()
    assert rows[0] == (report["message_id"], {"tenant": "acme"})  # no trace context added
    assert len(rows) == 2


def test_extras__installed_but_unused_they_are_never_imported(dsn: str) -> None:
    pytest.importorskip("opentelemetry.trace")  # the one the core could import (tracing)
    report = run(USE_THE_CORE.replace('("sqlalchemy", "django")', "()"), dsn)
    assert report["loaded"] == []
