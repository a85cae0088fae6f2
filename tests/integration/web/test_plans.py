"""What the console counts before an operator confirms is what the action then takes:
``plan_*`` (the stores' ``matching``) against ``retry_*``/``purge_*`` (the CLI's
statements), for every kind of selection, on real PostgreSQL."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

from outbox.config import Settings
from outbox.db.inbox import render_sql
from outbox.web import console
from outbox.web.console import DeadLetterSelection, InboxTarget

INBOX = "plan_inbox"


def add_dead_letters(dsn: str, keys: list[str | None]) -> list[int]:
    ids = []
    with psycopg.connect(dsn) as conn:
        for key in keys:
            row = conn.execute(
                "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, "
                "payload, created_at, reason, ordering_key) VALUES "
                "(nextval(pg_get_serial_sequence('outbox', 'id')), %s, 'ex', 'rk', 'p', now(), "
                "'r', %s) RETURNING id",
                [uuid.uuid4(), key],
            ).fetchone()
            assert row is not None
            ids.append(int(row[0]))
    return ids


SELECTIONS = {
    "one row": lambda ids: DeadLetterSelection(row_ids=(ids[0],)),
    "rows": lambda ids: DeadLetterSelection(row_ids=(ids[0], ids[3], 999_999)),
    "a key": lambda ids: DeadLetterSelection(ordering_keys=("k1",)),
    "rows and keys": lambda ids: DeadLetterSelection(row_ids=(ids[3],), ordering_keys=("k2",)),
    "nothing there": lambda ids: DeadLetterSelection(row_ids=(999_999,)),
}


@pytest.mark.parametrize("action", ["retry", "purge"])
@pytest.mark.parametrize("name", list(SELECTIONS))
def test_plan__dead_letters_counted_before_confirming_are_those_the_action_takes(
    settings: Settings, name: str, action: str
) -> None:
    ids = add_dead_letters(settings.dsn, ["k1", "k1", "k2", None, None])
    selection = SELECTIONS[name](ids)
    planned = console.plan_dead_letters(settings, selection)
    act = console.retry_dead_letters if action == "retry" else console.purge_dead_letters
    done = act(settings, selection)
    assert sorted(r["id"] for r in done) == [r["id"] for r in planned]
    with psycopg.connect(settings.dsn) as conn:
        left = [r[0] for r in conn.execute("SELECT id FROM outbox_dead_letters ORDER BY id")]
    assert left == sorted(set(ids) - {r["id"] for r in planned})


def test_plan__parked_messages_counted_before_confirming_are_those_purge_takes(
    settings: Settings,
) -> None:
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(render_sql(INBOX).replace("BEGIN;", "").replace("COMMIT;", ""))
        for consumer, message_id in [("a", "m1"), ("b", "m1"), ("a", "m2"), ("a", None)]:
            conn.execute(
                f"INSERT INTO {INBOX}_parked (consumer, message_id, queue, exchange, "
                "routing_key, body, headers, properties, error, attempts) VALUES "
                "(%s, %s, 'q', 'ex', 'rk', 'b', '{}', '{}', 'e', 1)",
                [consumer, message_id],
            )
    target = InboxTarget(settings.dsn, INBOX)
    planned = console.plan_parked(target, ["m1", "absent"])
    assert sorted((r["consumer"], r["message_id"]) for r in planned) == [("a", "m1"), ("b", "m1")]
    assert console.purge_parked(target, ["m1", "absent"]) == len(planned)
    left = console.parked_listing(target, "", 0, 10).rows
    assert [r["message_id"] for r in left] == ["m2", None]


def test_detail__a_long_dead_letter_is_read_in_part_with_its_size(settings: Settings) -> None:
    """Bodies were capped, headers were not: 21 MB of headers made a 23 MB page in
    2.45 s, and four at once took the console from 60 to 433 MB."""
    size = 4 * console.BODY_SHOWN
    headers = {f"h{n}": "v" * 100 for n in range(size // 100)}
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "headers, created_at, reason) VALUES (1, %s, 'ex', 'rk', %s, %s, now(), 'too large')",
            [uuid.uuid4(), b"x" * size, json.dumps(headers)],
        )
    found = console.dead_letter(settings, 1)
    assert found is not None
    assert (found["body"].shown, found["body"].size) == (console.BODY_SHOWN, size)
    shown = found["headers"]
    assert len(shown.text) == console.BODY_SHOWN and not shown.whole
    assert shown.size == len(json.dumps(headers))
    whole = console.dead_letter_value(settings, 1, "headers")
    assert whole is not None and whole.value is not None
    assert json.loads(whole.value) == headers
    payload = console.dead_letter_value(settings, 1, "payload")
    assert payload is not None and payload.value == b"x" * size
