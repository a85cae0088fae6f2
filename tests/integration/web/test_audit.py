"""The audit log cannot be forged: whatever a client puts in any field of a form,
every ``web.*`` event stays one entry (one line) in the text and JSON formats."""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Iterator

import psycopg
import pytest

from outbox.config import Settings
from outbox.events import JsonFormatter, TextFormatter
from tests.fixtures.web import Console, csrf_headers, http, inbox_console

INBOX = "audit_inbox"
FORGED = "2026-01-01 00:00:00,000 WARNING outbox.web web.dead_letters_purged who=alice rows=5000"
# Each way a client can start a new line, or hide one from a terminal.
BREAKS = ["\n", "\r", "\x1b[2K\r", "\u2028", "\x85", "\x00"]


@pytest.fixture
def console(settings: Settings) -> Iterator[Console]:
    with inbox_console(settings, INBOX) as running:
        yield running


@pytest.fixture
def logged() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """What the console's events look like in each format, as `outbox web` writes them."""
    text, jsonl = io.StringIO(), io.StringIO()
    handlers = [logging.StreamHandler(text), logging.StreamHandler(jsonl)]
    handlers[0].setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    handlers[1].setFormatter(JsonFormatter())
    web = logging.getLogger("outbox.web")
    for handler in handlers:
        web.addHandler(handler)
    yield text, jsonl
    for handler in handlers:
        web.removeHandler(handler)


def add_dead_letter(dsn: str, key: str | None = None) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, reason, ordering_key) VALUES "
            "(nextval(pg_get_serial_sequence('outbox', 'id')), %s, 'ex', 'rk', 'p', now(), "
            "'r', %s) RETURNING id",
            [uuid.uuid4(), key],
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("line_break", BREAKS, ids=[repr(b) for b in BREAKS])
def test_web__no_form_field_can_forge_an_audit_entry(
    line_break: str,
    settings: Settings,
    console: Console,
    logged: tuple[io.StringIO, io.StringIO],
) -> None:
    forged = line_break + FORGED
    headers = csrf_headers(console)
    posts: list[tuple[str, dict[str, str]]] = []
    key = ("k" + forged).replace("\x00", "")  # PostgreSQL text holds no NUL
    for field in ("expected", "id", "key", "table", "csrf_token"):
        row_id = add_dead_letter(settings.dsn, key=key)
        form = {"id": str(row_id), "expected": "1", field: f"1{forged}"}
        if field == "key":
            form["key"] = key  # an existing key, as a confirmation page posts it
        posts += [("/dead-letters/purge", form), ("/dead-letters/retry", form)]
    for field in ("expected", "id", "inbox", "csrf_token"):
        posts.append(("/parked/purge", {"id": "m-1", "expected": "1", field: f"1{forged}"}))
    posts.append(("/in-doubt/resolve", {"table": f"outbox{forged}"}))
    statuses = [http(console.url + path, data=form, headers=headers)[0] for path, form in posts]
    assert 200 in statuses  # some were acted on (and logged), others refused

    text, jsonl = logged
    entries = [json.loads(line) for line in jsonl.getvalue().splitlines()]
    assert entries and all(e["event"].startswith("web.") for e in entries)
    lines = text.getvalue().split("\n")[:-1]
    assert len(lines) == len(entries)  # one line per entry
    assert not [line for line in lines if not line.startswith("20") or "\r" in line]
    for line in lines:
        assert not any(c in line for c in "\x00\x0b\x0c\x1b\x85\u2028\u2029"), repr(line)
    for entry in entries:  # JSON escapes any character; but the values must not read as
        # lines either when a log shipper prints them
        assert not any(
            isinstance(v, str) and any(c in v for c in "\n\r\x1b\x85\u2028") for v in entry.values()
        ), entry
