"""``outbox dead-letters list | retry | purge`` as users run them."""

from __future__ import annotations

import json
import uuid

import psycopg

from outbox.config import Settings
from tests.fixtures.servers import Topology, run_cli, settings_env
from tests.integration.relay.test_dead_letters import dead_letters, insert
from tests.integration.relay.test_relay import relay_drain, remaining_rows


def add_dead_letter(dsn: str, *, failed_days_ago: float = 0, reason: str = "test") -> str:
    message_id = uuid.uuid4()
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, reason, failed_at) VALUES (nextval(pg_get_serial_sequence('outbox', "
            "'id')), %s, 'ex', 'rk', 'p', now(), %s, now() - make_interval(days => %s))",
            [message_id, reason, failed_days_ago],
        )
    return str(message_id)


def test_dead_letters_list__json_has_id_reason_when_and_destination(
    settings: Settings, topology: Topology
) -> None:
    message_id = insert(settings.dsn, f"{topology.exchange}.missing", "order.created", b"12345")
    relay_drain(settings)

    result = run_cli("dead-letters", "list", "--json", env=settings_env(settings))

    assert result.returncode == 0, result.stderr
    [entry] = json.loads(result.stdout)["dead_letters"]
    assert entry["message_id"] == message_id
    assert "does not exist" in entry["reason"]
    assert entry["exchange"] == f"{topology.exchange}.missing"
    assert entry["routing_key"] == "order.created"
    assert entry["payload_bytes"] == 5
    assert entry["failed_at"] and entry["gid"].startswith("obx:outbox:")
    text = run_cli("dead-letters", "list", env=settings_env(settings))
    assert message_id in text.stdout and "does not exist" in text.stdout


def test_dead_letters_retry__after_the_fix_the_row_is_published_with_its_message_id(
    settings: Settings, topology: Topology
) -> None:
    missing = f"{topology.exchange}.later"
    message_id = insert(settings.dsn, missing, "k", b"payload")
    kept = add_dead_letter(settings.dsn)
    relay_drain(settings)
    assert message_id in dead_letters(settings.dsn)

    ch = topology.channel()  # the fix: the exchange now exists and routes
    ch.exchange_declare(missing, "fanout", auto_delete=False)
    ch.queue_bind(topology.queue, missing)
    try:
        result = run_cli("dead-letters", "retry", message_id, env=settings_env(settings))
        assert result.returncode == 0, result.stderr
        assert "1 dead letters moved back" in result.stdout
        assert set(dead_letters(settings.dsn)) == {kept}
        assert remaining_rows(settings.dsn) == 1
        relay_drain(settings)
    finally:
        ch.exchange_delete(missing)
        ch.connection.close()
    [(_, props, body)] = topology.messages()
    assert (props.message_id, body) == (message_id, b"payload")
    assert remaining_rows(settings.dsn) == 0


def test_dead_letters_retry__all_moves_every_row_in_one_go(settings: Settings) -> None:
    ids = {add_dead_letter(settings.dsn) for _ in range(3)}
    result = run_cli("dead-letters", "retry", "--all", env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    with psycopg.connect(settings.dsn) as conn:
        moved = {str(r[0]) for r in conn.execute("SELECT message_id FROM outbox").fetchall()}
    assert moved == ids
    assert dead_letters(settings.dsn) == {}


def test_dead_letters_retry__unknown_id_exits_1_and_moves_the_known_ones(
    settings: Settings,
) -> None:
    known = add_dead_letter(settings.dsn)
    unknown = str(uuid.uuid4())
    result = run_cli("dead-letters", "retry", known, unknown, env=settings_env(settings))
    assert result.returncode == 1
    assert unknown in result.stderr
    assert dead_letters(settings.dsn) == {}
    assert remaining_rows(settings.dsn) == 1


def test_dead_letters_retry_and_purge__refuse_to_guess_what_to_touch(settings: Settings) -> None:
    add_dead_letter(settings.dsn)
    env = settings_env(settings)
    assert run_cli("dead-letters", "retry", env=env).returncode == 2
    assert run_cli("dead-letters", "purge", env=env).returncode == 2
    assert run_cli("dead-letters", "purge", "not-a-uuid", env=env).returncode == 2
    assert run_cli("dead-letters", "purge", "--older-than", "soon", env=env).returncode == 2
    assert len(dead_letters(settings.dsn)) == 1


def test_dead_letters_purge__older_than_keeps_recent_ones(settings: Settings) -> None:
    old = add_dead_letter(settings.dsn, failed_days_ago=40)
    recent = add_dead_letter(settings.dsn, failed_days_ago=1)
    env = settings_env(settings)

    result = run_cli("dead-letters", "purge", "--older-than", "30d", env=env)

    assert result.returncode == 0, result.stderr
    assert "1 dead letters purged" in result.stdout
    assert set(dead_letters(settings.dsn)) == {recent}
    assert old not in dead_letters(settings.dsn)
    assert run_cli("dead-letters", "purge", recent, env=env).returncode == 0
    assert dead_letters(settings.dsn) == {}


def test_dead_letters_purge__all(settings: Settings) -> None:
    for _ in range(3):
        add_dead_letter(settings.dsn)
    result = run_cli("dead-letters", "purge", "--all", env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    assert dead_letters(settings.dsn) == {}


def test_dead_letters__rows_sharing_a_message_id_are_two_dead_letters_retried_by_id(
    settings: Settings, topology: Topology
) -> None:
    shared = str(uuid.uuid4())
    with psycopg.connect(settings.dsn) as conn:
        ids = [
            r[0]
            for r in conn.execute(
                "INSERT INTO outbox (message_id, exchange, routing_key, payload) VALUES "
                "(%(m)s, %(missing)s, 'k', 'one'), (%(m)s, %(missing)s, 'k', 'two') RETURNING id",
                {"m": shared, "missing": f"{topology.exchange}.missing"},
            ).fetchall()
        ]
    relay_drain(settings)
    env = settings_env(settings)
    listed = json.loads(run_cli("dead-letters", "list", "--json", env=env).stdout)
    assert sorted(e["id"] for e in listed["dead_letters"]) == ids
    assert {e["message_id"] for e in listed["dead_letters"]} == {shared}

    one = run_cli("dead-letters", "retry", str(ids[0]), env=env)
    assert one.returncode == 0 and "1 dead letters moved back" in one.stdout, one.stderr
    both = run_cli("dead-letters", "retry", shared, env=env)
    assert both.returncode == 0 and "1 dead letters moved back" in both.stdout, both.stderr
    with psycopg.connect(settings.dsn) as conn:
        back = conn.execute("SELECT id, payload FROM outbox ORDER BY id").fetchall()
    assert [(i, bytes(p)) for i, p in back] == [(ids[0], b"one"), (ids[1], b"two")]


def test_dead_letters_retry__a_row_also_back_in_the_outbox_is_not_doubled(
    settings: Settings,
) -> None:
    """After a rollback a row can be in both tables: retry keeps the one outbox row."""
    with psycopg.connect(settings.dsn) as conn:
        [(row_id, message_id)] = conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) VALUES ('ex', 'k', 'p') "
            "RETURNING id, message_id"
        ).fetchall()
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload, "
            "created_at, reason) VALUES (%s, %s, 'ex', 'k', 'p', now(), 'rolled back')",
            [row_id, message_id],
        )
    result = run_cli("dead-letters", "retry", str(message_id), env=settings_env(settings))
    assert result.returncode == 0, result.stderr
    assert dead_letters(settings.dsn) == {}
    assert remaining_rows(settings.dsn) == 1


def test_dead_letters_retry__a_row_held_by_an_in_doubt_batch_names_it_and_exits_6(
    settings: Settings,
) -> None:
    """Issue 30, item 1: the dead letter of a row whose batch is in doubt (its relay
    killed before COMMIT PREPARED, none running): `retry` waited on the prepared
    batch forever (`Lock/transactionid`, no lock_timeout).  Now it gives up after
    --lock-timeout with one line naming the batch and `outbox resolve`."""
    message_id = add_dead_letter(settings.dsn)
    gid = f"obx:outbox:{uuid.uuid4().hex}:1"
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        # The row the batch claimed and dead-lettered, deleted by the batch, prepared.
        conn.execute(
            "INSERT INTO outbox (id, message_id, exchange, routing_key, payload)"
            " OVERRIDING SYSTEM VALUE"
            " SELECT id, message_id, exchange, routing_key, payload FROM outbox_dead_letters"
        )
        conn.execute("BEGIN")
        conn.execute("DELETE FROM outbox")
        conn.execute(f"PREPARE TRANSACTION '{gid}'")
    env = {**settings_env(settings), "OUTBOX_LOCK_TIMEOUT": "1"}
    result = run_cli("dead-letters", "retry", message_id, env=env, timeout=30)
    assert result.returncode == 6, result.stderr
    first, *rest = result.stderr.splitlines()
    assert first.startswith("error: PostgreSQL gave up waiting for a lock while retrying")
    assert f"in-doubt batch {gid!r}" in first and "`outbox resolve`" in first, first
    assert [line for line in rest if not line.startswith("  hint: ")] == []
    listed = run_cli("dead-letters", "list", "--json", env=env)
    assert [e["message_id"] for e in json.loads(listed.stdout)["dead_letters"]] == [message_id]
