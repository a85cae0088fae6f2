"""Missing privileges: one clear line with the GRANT, never a traceback or a crash loop.

Issue 9, item 5.  Each test uses a real login role in the test database.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections import Counter

import psycopg
import pytest

from outbox.config import Settings
from outbox.db import migrate, privileges
from outbox.errors import ExitCode, MissingPrivileges
from outbox.relay.process import Relay
from tests.acceptance.test_cli import assert_one_clear_error
from tests.fixtures.faults import both_modes, prepared_left, wait_for
from tests.fixtures.servers import DbRole, Topology, run_cli, settings_env
from tests.integration.relay.test_bad_rows import RunningRelay, dead_letter_rows
from tests.integration.relay.test_relay import relay_drain, remaining_rows


def grant(role: DbRole, needs: privileges.Needs) -> None:
    role.grant(*privileges.grants(privileges.wanted("outbox", needs), "{role}"))


def as_role(settings: Settings, role: DbRole) -> Settings:
    return dataclasses.replace(settings, dsn=role.dsn)


@pytest.mark.parametrize(
    ("command", "missing"),
    [
        (["relay", "--drain"], "GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO"),
        (["status"], "GRANT SELECT ON outbox TO"),
        (["resolve"], "GRANT SELECT, DELETE ON outbox_relays TO"),
        (["dead-letters", "list"], "GRANT SELECT ON outbox_dead_letters TO"),
        (["dead-letters", "retry", "--all"], "GRANT SELECT, INSERT ON outbox TO"),
        (["dead-letters", "purge", "--all"], "GRANT SELECT, DELETE ON outbox_dead_letters TO"),
        (["init"], "the outbox tables"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_preflight__a_role_without_rights_gets_one_line_naming_the_grant(
    command: list[str], missing: str, settings: Settings, db_role: DbRole
) -> None:
    result = run_cli(*command, env=settings_env(as_role(settings, db_role)))
    assert_one_clear_error(result, int(ExitCode.NOT_READY), missing)
    if command[0] != "init":
        assert f"TO {db_role.name};" in result.stderr


def test_preflight__init_in_a_schema_the_role_may_not_create_in(
    empty_dsn: str, db_role: DbRole
) -> None:
    dsn = psycopg.conninfo.make_conninfo(empty_dsn, user=db_role.name)
    result = run_cli("init", "--dsn", dsn)
    assert_one_clear_error(
        result,
        int(ExitCode.NOT_READY),
        "may not create tables in schema 'public'",
        f"GRANT CREATE ON SCHEMA public TO {db_role.name};",
    )


def test_preflight__names_only_what_is_missing(settings: Settings, db_role: DbRole) -> None:
    grant(db_role, privileges.RELAY)
    db_role.grant("REVOKE UPDATE ON outbox_dead_letters FROM {role}")
    relay = Relay(as_role(settings, db_role))
    with pytest.raises(MissingPrivileges) as raised:
        relay.start()
    relay.close()
    assert "UPDATE on outbox_dead_letters" in raised.value.message
    assert raised.value.hint.endswith(f"GRANT UPDATE ON outbox_dead_letters TO {db_role.name};")


def test_documented_grants__are_all_each_command_needs(
    settings: Settings, topology: Topology, db_role: DbRole
) -> None:
    """The lists in outbox/db/privileges.py (and docs/reference/privileges.md) are enough,
    bad rows included."""
    for needs in (
        privileges.RELAY,
        privileges.STATUS,
        privileges.DEAD_LETTERS_LIST,
        privileges.DEAD_LETTERS_RETRY,
        privileges.DEAD_LETTERS_PURGE,
        privileges.RESOLVE,
    ):
        grant(db_role, needs)
    restricted = as_role(settings, db_role)
    with psycopg.connect(settings.dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) VALUES "
            "(%(ex)s, 'k', 'good'), (%(missing)s, 'k', 'dead'), (%(missing)s, 'k', 'dead')",
            {"ex": topology.exchange, "missing": f"{topology.exchange}.missing"},
        )

    relay = relay_drain(restricted)
    relay_drain(restricted)  # dead-lettered again after a rollback: ON CONFLICT DO UPDATE

    assert relay.stats.messages_published == 1 and relay.stats.dead_letters == 2
    env = settings_env(restricted)
    assert run_cli("status", env=env).returncode == int(ExitCode.FAILURE)  # dead letters
    assert run_cli("resolve", env=env).returncode == 0
    assert run_cli("dead-letters", "list", env=env).returncode == 0
    [first, second] = dead_letter_rows(settings.dsn)
    assert run_cli("dead-letters", "retry", str(first["id"]), env=env).returncode == 0
    assert run_cli("dead-letters", "purge", str(second["id"]), env=env).returncode == 0
    assert remaining_rows(settings.dsn) == 1 and dead_letter_rows(settings.dsn) == []


@both_modes
def test_dead_letter_write_refused_while_running__rolls_back_once_and_backs_off(
    settings: Settings, topology: Topology, db_role: DbRole
) -> None:
    """Before: each run left a prepared batch and re-published the good rows (6 → 12 → 18)."""
    grant(db_role, privileges.RELAY)
    restricted = as_role(settings, db_role)
    good = [f"good-{i}".encode() for i in range(6)]
    with RunningRelay(restricted) as running:
        wait_for(lambda: running.relay.relay_id != "", 30, "the relay to start")
        db_role.grant("REVOKE INSERT ON outbox_dead_letters FROM {role}")
        with psycopg.connect(settings.dsn) as conn:
            conn.cursor().executemany(
                "INSERT INTO outbox (exchange, routing_key, payload) VALUES (%s, %s, %s)",
                [(topology.exchange, "k", body) for body in good]
                + [
                    (f"{topology.exchange}.missing", "k", b"no-exchange"),
                    ("", f"nowhere.{time.time_ns()}", b"unroutable"),
                ],
            )
        inserted = time.monotonic()
        stats = running.relay.stats
        wait_for(lambda: stats.batches_rolled_back >= 6, 30, "six tries of the batch")
        took = time.monotonic() - inserted

        assert running.alive
        # Backoff 0.05 s doubling to 0.5 s, each wait at least half of that: the five
        # waits between six tries take 0.625 s or more, however fast the machine (a
        # busy loop takes milliseconds).
        assert took >= 0.025 + 0.05 + 0.1 + 0.2 + 0.25, f"six tries in {took:.3f} s"
        assert remaining_rows(settings.dsn) == 8, "no row left the outbox"
        assert len(prepared_left(settings.dsn)) <= 1  # at most the batch being tried
        first = Counter(body for _, _, body in topology.messages())
        assert first == Counter(good), "the good rows went out once, not once per retry"
        assert stats.duplicates_possible == len(good)
        assert "outbox_dead_letters" in (stats.last_error or "")

        db_role.grant("GRANT INSERT ON outbox_dead_letters TO {role}")
        running.wait_until_empty(settings.dsn, timeout=20)
        assert running.alive

    assert Counter(body for _, _, body in topology.messages()) == Counter(good)
    assert sorted(bytes(r["payload"]) for r in dead_letter_rows(settings.dsn)) == [
        b"no-exchange",
        b"unroutable",
    ]
    assert prepared_left(settings.dsn) == []


# What a relay needed up to schema 8: no scheduled rows to move.
SCHEMA_8_RELAY = {
    **{role: needs for role, needs in privileges.RELAY.items() if role != privileges.SCHEDULED},
    privileges.OUTBOX: ("SELECT", "UPDATE", "DELETE"),
}


def test_upgrade_to_schema_9__grants_applications_and_relays_the_scheduled_rows(
    dsn: str, db_role: DbRole
) -> None:
    """A relay role granted what schema 8 needed may move due rows after ``outbox
    init`` adds ``<table>_scheduled`` (schema 9), an application that may insert into
    the outbox may schedule and cancel, and a reader may read the scheduled rows: no
    GRANT of the operator's own, no relay refused at start."""
    table = f"up9_{uuid.uuid4().hex[:8]}"
    app, reader = f"{db_role.name}_app", f"{db_role.name}_st"
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate.migrate(conn, table, target=8)
        db_role.grant(*privileges.grants(privileges.wanted(table, SCHEMA_8_RELAY), "{role}"))
        conn.execute(f"CREATE ROLE {app}")
        conn.execute(f"GRANT INSERT ON {table} TO {app}")
        conn.execute(f"CREATE ROLE {reader}")
        conn.execute(f"GRANT SELECT ON {table} TO {reader}")
        try:
            migrate.migrate(conn, table)
            held = {
                (who, relation, p)
                for who in (db_role.name, app, reader)
                for relation in (table, f"{table}_scheduled")
                for p in ("SELECT", "INSERT", "UPDATE", "DELETE")
                if conn.execute(
                    "SELECT has_table_privilege(%s, %s, %s)", [who, relation, p]
                ).fetchone()[0]  # type: ignore[index]
            }
        finally:
            for role in (app, reader):
                conn.execute(f"DROP OWNED BY {role}")
                conn.execute(f"DROP ROLE {role}")
    scheduled = f"{table}_scheduled"
    assert {(t, p) for who, t, p in held if who == db_role.name} == {
        (table, "SELECT"),
        (table, "INSERT"),
        (table, "UPDATE"),
        (table, "DELETE"),
        (scheduled, "SELECT"),
        (scheduled, "UPDATE"),
        (scheduled, "DELETE"),
    }
    assert {(t, p) for who, t, p in held if who == app} == {
        (table, "INSERT"),
        (scheduled, "SELECT"),
        (scheduled, "INSERT"),
        (scheduled, "DELETE"),
    }
    assert {(t, p) for who, t, p in held if who == reader} == {
        (table, "SELECT"),
        (scheduled, "SELECT"),
    }


def test_upgrade_to_schema_7__carries_the_relays_and_status_grants_to_the_saved_front(
    dsn: str, db_role: DbRole
) -> None:
    """A relay role granted what schema 6 needed keeps working after ``outbox init``
    adds ``<table>_claim_front`` (schema 7): the migration grants it what the relay
    needs there, and a role that may only read the outbox gets SELECT.  Before, the
    relay refused to start until an operator ran the GRANT."""
    table = f"up7_{uuid.uuid4().hex[:8]}"
    schema_6 = {**SCHEMA_8_RELAY}
    del schema_6["claim_front"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate.migrate(conn, table, target=6)
        db_role.grant(*privileges.grants(privileges.wanted(table, schema_6), "{role}"))
        conn.execute(f"CREATE ROLE {db_role.name}_st")
        conn.execute(f"GRANT SELECT ON {table} TO {db_role.name}_st")
        try:
            migrate.migrate(conn, table)
            front = f"{table}_claim_front"
            held = {
                (who, p): conn.execute(
                    "SELECT has_table_privilege(%s, %s, %s)", [who, front, p]
                ).fetchone()[0]  # type: ignore[index]
                for who in (db_role.name, f"{db_role.name}_st")
                for p in ("SELECT", "INSERT", "UPDATE")
            }
        finally:
            conn.execute(f"DROP OWNED BY {db_role.name}_st")
            conn.execute(f"DROP ROLE {db_role.name}_st")
    assert held == {
        (db_role.name, "SELECT"): True,
        (db_role.name, "INSERT"): True,
        (db_role.name, "UPDATE"): True,
        (f"{db_role.name}_st", "SELECT"): True,
        (f"{db_role.name}_st", "INSERT"): False,
        (f"{db_role.name}_st", "UPDATE"): False,
    }


def test_upgrade_to_schema_7__run_by_another_role_carries_the_outbox_owners_rights(
    dsn: str, db_role: DbRole
) -> None:
    """The relay runs as the role that owns the outbox (it ran ``outbox init`` up to
    schema 6, so it was granted nothing: an owner's rights are implicit and its
    ACL may be empty), and a DBA's role runs ``outbox init`` for schema 7, so the
    DBA owns ``<table>_claim_front``.  The owner of the outbox must still be able
    to save and read the front: a relay of 0.6 is not refused at start.  Before,
    the migration granted only the roles listed in the outbox's ACL, not its owner."""
    table = f"own7_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"GRANT CREATE ON SCHEMA public TO {db_role.name}")
    with psycopg.connect(db_role.dsn, autocommit=True) as conn:
        migrate.migrate(conn, table, target=6)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate.migrate(conn, table)
    with psycopg.connect(db_role.dsn, autocommit=True) as conn:
        front = f"{table}_claim_front"
        held = {
            p: conn.execute("SELECT has_table_privilege(%s, %s)", [front, p]).fetchone()[0]  # type: ignore[index]
            for p in ("SELECT", "INSERT", "UPDATE")
        }
    assert held == {"SELECT": True, "INSERT": True, "UPDATE": True}
