"""outbox.integrations.django against real PostgreSQL and RabbitMQ.

Enqueue inside ``transaction.atomic()`` publishes on commit and never on rollback;
the row is identical to plain SQL's and ``outbox.enqueue``'s; ``manage.py migrate``
and ``manage.py outbox_init`` create the same schema as ``outbox init``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

pytest.importorskip("django")

import django
from django.db import connections, transaction

import outbox
from outbox.config import Settings
from outbox.db import migrate
from outbox.errors import OutboxError
from outbox.relay.process import Relay
from tests.fixtures.servers import Topology

ROOT = Path(__file__).resolve().parents[3]
SETTINGS_MODULE = "tests.fixtures.django_settings"
PAYLOAD = b'\x00\xff{"id": 1}\n\xe9'
HEADERS = {"tenant": "acmé", "n": 7, "flags": [True, None, "x"], "nested": {"a": {"b": -1}}}


@pytest.fixture(scope="module")
def django_ready() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", SETTINGS_MODULE)
    django.setup()


@pytest.fixture
def django_db(dsn: str, django_ready: None) -> Iterator[str]:
    """Django's default database pointed at this test's database, with an orders table."""
    from outbox.integrations import django as outbox_django  # noqa: F401 - needs settings

    info = psycopg.conninfo.conninfo_to_dict(dsn)
    connection = connections["default"]
    connection.close()
    connection.settings_dict.update(
        NAME=info.get("dbname", ""),
        USER=info.get("user", ""),
        PASSWORD=info.get("password", ""),
        HOST=info.get("host", ""),
        PORT=info.get("port", ""),
    )
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    yield dsn
    connection.close()


def drain(settings: Settings) -> None:
    relay = Relay(settings)
    relay.start()
    relay.run(drain=True)


def committed_rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM outbox").fetchone()[0]  # type: ignore[index]


def insert_order(order_id: int) -> None:
    with connections["default"].cursor() as cursor:
        cursor.execute("INSERT INTO orders VALUES (%s)", [order_id])


def test_django__atomic_commit_publishes_rollback_never_does(
    django_db: str, settings: Settings, topology: Topology
) -> None:
    from outbox.integrations import django as outbox_django

    with transaction.atomic():
        insert_order(1)
        kept = outbox_django.enqueue(exchange=topology.exchange, routing_key="a", payload=b"1")
        with pytest.raises(ZeroDivisionError), transaction.atomic():  # a savepoint
            outbox_django.enqueue(exchange=topology.exchange, routing_key="inner", payload=b"x")
            raise ZeroDivisionError
        kept_json = outbox_django.enqueue_json(
            exchange=topology.exchange, routing_key="b", body={"id": 1}
        )
        assert committed_rows(django_db) == 0  # nothing committed on its own
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        insert_order(2)
        outbox_django.enqueue_many(
            [outbox.OutgoingMessage(topology.exchange, "lost", b"2") for _ in range(3)]
        )
        raise ZeroDivisionError

    drain(settings)
    got = {props.message_id: method.routing_key for method, props, _ in topology.messages()}
    assert got == {str(kept): "a", str(kept_json): "b"}
    with psycopg.connect(django_db) as conn:
        assert conn.execute("SELECT array_agg(id) FROM orders").fetchone() == ([1],)


def test_django__outside_atomic_is_refused_before_writing(django_db: str) -> None:
    from outbox.integrations import django as outbox_django

    with pytest.raises(OutboxError, match="outside a transaction") as caught:
        outbox_django.enqueue(exchange="", routing_key="k", payload=b"1")
    assert "transaction.atomic()" in caught.value.hint
    assert committed_rows(django_db) == 0


def test_django__row_is_identical_to_plain_sql_and_outbox_enqueue(
    django_db: str, settings: Settings, topology: Topology
) -> None:
    from outbox.integrations import django as outbox_django

    plain_id, helper_id, core_id, many_id = (uuid.uuid4() for _ in range(4))
    with transaction.atomic(), connections["default"].cursor() as cursor:
        cursor.execute(
            "INSERT INTO outbox (message_id, exchange, routing_key, payload, headers, "
            "content_type) VALUES (%s, %s, 'k', %s, %s::jsonb, 'text/x')",
            [
                plain_id,
                topology.exchange,
                PAYLOAD,
                '{"tenant": "acmé", "n": 7, "flags": [true, null, "x"], '
                '"nested": {"a": {"b": -1}}}',
            ],
        )
        outbox_django.enqueue(
            exchange=topology.exchange,
            routing_key="k",
            payload=PAYLOAD,
            headers=HEADERS,
            content_type="text/x",
            message_id=helper_id,
        )
        outbox_django.enqueue_many(
            [outbox.OutgoingMessage(topology.exchange, "k", PAYLOAD, HEADERS, "text/x", many_id)]
        )
    with psycopg.connect(django_db) as conn:
        outbox.enqueue(
            conn,
            exchange=topology.exchange,
            routing_key="k",
            payload=PAYLOAD,
            headers=HEADERS,
            content_type="text/x",
            message_id=core_id,
        )
        rows = {
            r[0]: r[1:]
            for r in conn.execute(
                "SELECT message_id, exchange, routing_key, payload, headers::text, "
                "content_type FROM outbox"
            )
        }
    assert rows[plain_id] == rows[helper_id] == rows[many_id] == rows[core_id]
    assert rows[helper_id][2] == PAYLOAD

    drain(settings)
    published = {
        props.message_id: (method.routing_key, props.headers, props.content_type, body)
        for method, props, body in topology.messages()
    }
    assert len(published) == 4
    for message_id in rows:
        assert published[str(message_id)] == ("k", HEADERS, "text/x", PAYLOAD)


def test_django__enqueue_stores_the_active_spans_traceparent(django_db: str) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from outbox.integrations import django as outbox_django
    from tests.fixtures.tracing import recorded_spans, tracer

    recorded_spans()
    with tracer().start_as_current_span("POST /orders") as span, transaction.atomic():
        outbox_django.enqueue(exchange="", routing_key="k", payload=b"1", headers={"a": 1})
    with psycopg.connect(django_db) as conn:
        [(headers,)] = conn.execute("SELECT headers FROM outbox").fetchall()
    ctx = span.get_span_context()
    assert headers["a"] == 1
    assert headers["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")


def test_django__the_insert_goes_through_djangos_cursor(django_db: str) -> None:
    """Query logging (and instrumentation hooked on Django's cursor) sees the statement."""
    from outbox.integrations import django as outbox_django

    connection = connections["default"]
    connection.force_debug_cursor = True  # log queries as with DEBUG = True
    try:
        with transaction.atomic():
            outbox_django.enqueue(exchange="", routing_key="k", payload=b"1", headers={"a": 1})
        logged = [q["sql"] for q in connection.queries]
    finally:
        connection.force_debug_cursor = False
    assert any(sql.startswith('INSERT INTO "outbox"') and "'k'" in sql for sql in logged), logged


# -- the schema: manage.py migrate and manage.py outbox_init, as users run them ----------
def django_admin(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": SETTINGS_MODULE,
        "OUTBOX_TEST_DJANGO_DSN": dsn,
        "PYTHONPATH": str(ROOT),
    }
    return subprocess.run(
        [sys.executable, "-m", "django", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


def schema_of(dsn: str, table: str = "outbox") -> dict[str, list[tuple[object, ...]]]:
    """What ``outbox init`` creates, as the catalog describes it."""
    like = table.replace("_", r"\_") + "%"
    queries = {
        "columns": "SELECT table_name, column_name, data_type, column_default, is_nullable "
        "FROM information_schema.columns WHERE table_schema = 'public' AND table_name LIKE %s",
        "indexes": "SELECT tablename, indexdef FROM pg_indexes "
        "WHERE schemaname = 'public' AND tablename LIKE %s",
        "triggers": "SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) "
        "FROM pg_trigger WHERE NOT tgisinternal AND tgrelid::regclass::text LIKE %s",
        "options": "SELECT relname, reloptions FROM pg_class WHERE relname LIKE %s",
        "functions": "SELECT proname, prosrc FROM pg_proc WHERE proname LIKE %s",
    }
    with psycopg.connect(dsn) as conn:
        schema = {
            name: sorted(conn.execute(query, [like]).fetchall(), key=repr)  # type: ignore[arg-type]
            for name, query in queries.items()
        }
        schema["versions"] = conn.execute(
            f"SELECT version, name FROM {table}_schema_version ORDER BY version"
        ).fetchall()
    return schema


def test_django__migrate_creates_the_schema_outbox_init_creates(
    empty_dsn: str, dsn: str, settings: Settings, topology: Topology
) -> None:
    result = django_admin(empty_dsn, "migrate", "outbox")
    assert result.returncode == 0, result.stderr
    assert "Applying outbox.0001_outbox... OK" in result.stdout
    assert schema_of(empty_dsn) == schema_of(dsn)  # dsn: made by migrate.migrate directly
    assert schema_of(empty_dsn)["columns"]  # (not two empty schemas)

    result = django_admin(empty_dsn, "outbox_init")
    assert (result.returncode, result.stdout.strip()) == (
        0,
        f"schema of 'outbox' is up to date (version {migrate.LATEST_VERSION})",
    )

    # The relay works on the Django-made schema.
    with psycopg.connect(empty_dsn) as conn:
        message_id = outbox.enqueue(conn, exchange=topology.exchange, routing_key="k", payload=b"1")
    drain(dataclasses.replace(settings, dsn=empty_dsn))
    assert [props.message_id for _, props, _ in topology.messages()] == [str(message_id)]


def test_django__migrate_after_outbox_init_changes_nothing(empty_dsn: str, dsn: str) -> None:
    assert django_admin(empty_dsn, "outbox_init").returncode == 0
    result = django_admin(empty_dsn, "migrate", "outbox")
    assert result.returncode == 0, result.stderr
    assert schema_of(empty_dsn) == schema_of(dsn)


def test_django__outbox_init_command_applies_once_and_prints_sql(
    empty_dsn: str, pg_server: str
) -> None:
    result = django_admin(empty_dsn, "outbox_init", "--table", "shop_outbox")
    assert (result.returncode, result.stdout.strip()) == (
        0,
        f"schema of 'shop_outbox' migrated from nothing to {migrate.LATEST_VERSION}",
    )
    with psycopg.connect(empty_dsn) as conn:
        assert migrate.current_version(conn, "shop_outbox") == migrate.LATEST_VERSION  # type: ignore[arg-type]
    again = django_admin(empty_dsn, "outbox_init", "--table", "shop_outbox")
    assert "is up to date" in again.stdout

    printed = django_admin(empty_dsn, "outbox_init", "--print-sql", "--table", "t1")
    assert printed.returncode == 0
    assert printed.stdout == migrate.render_sql("t1")


def test_django__outbox_init_on_a_non_postgresql_database_is_one_line(tmp_path: Path) -> None:
    result = django_admin(f"sqlite:{tmp_path / 'db.sqlite3'}", "outbox_init")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert (
        "CommandError: database 'default' is sqlite; the outbox needs PostgreSQL" in result.stderr
    )
    assert "hint:" in result.stderr


def test_django__outbox_init_with_the_database_down_is_one_line() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = django_admin(f"postgresql://postgres@127.0.0.1:{port}/app", "outbox_init")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("CommandError: database 'default': connection failed")


def test_django__one_django_migration_per_schema_version() -> None:
    """Django runs a migration once: a new schema file needs a new Django migration."""
    folder = ROOT / "outbox" / "integrations" / "django" / "migrations"
    django_migrations = sorted(p.name for p in folder.glob("[0-9][0-9][0-9][0-9]_*.py"))
    assert len(django_migrations) == len(migrate.migrations())


def test_django__schedules_and_cancels_in_the_atomic_block(django_db: str) -> None:
    from outbox.integrations import django as outbox_django

    with transaction.atomic():
        later = outbox_django.enqueue(
            exchange="e", routing_key="k", payload=b"1", delay=datetime.timedelta(hours=1)
        )
        dropped = outbox_django.enqueue_json(
            exchange="e", routing_key="k", body={}, delay=datetime.timedelta(hours=1)
        )
    with transaction.atomic():
        assert outbox_django.cancel(dropped) is True
        assert outbox_django.cancel(uuid.uuid4()) is False
    with psycopg.connect(django_db) as conn:
        rows = conn.execute(
            "SELECT message_id, deliver_at - created_at FROM outbox_scheduled"
        ).fetchall()
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    assert rows == [(later, datetime.timedelta(hours=1))]
