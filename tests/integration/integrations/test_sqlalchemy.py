"""outbox.integrations.sqlalchemy against real PostgreSQL and RabbitMQ.

The row is written in the session's transaction: committed, the relay publishes it;
rolled back, never; and it is the same row, byte for byte, as one written by plain
SQL or by ``outbox.enqueue``.
"""

from __future__ import annotations

import asyncio
import datetime
import uuid
from collections.abc import Iterator

import psycopg
import pytest

pytest.importorskip("sqlalchemy")
pytest.importorskip("greenlet")  # AsyncSession

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import outbox
from outbox.config import Settings
from outbox.enqueue import insert_sql
from outbox.errors import OutboxError
from outbox.integrations import sqlalchemy as outbox_sa
from outbox.relay.process import Relay
from tests.fixtures.servers import Topology

# Binary payload with a NUL byte and non-UTF-8, nested headers with unicode, a content type:
# everything whose encoding could differ between two ways of writing a row.
PAYLOAD = b'\x00\xff{"id": 1}\n\xe9'
HEADERS = {"tenant": "acmé", "n": 7, "flags": [True, None, "x"], "nested": {"a": {"b": -1}}}


def sqlalchemy_url(dsn: str) -> sa.URL:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    return sa.URL.create(
        "postgresql+psycopg",
        username=str(info.get("user") or "") or None,
        password=str(info.get("password") or "") or None,
        host=str(info.get("host") or "") or None,
        port=int(info["port"]) if info.get("port") else None,
        database=str(info.get("dbname") or "") or None,
    )


@pytest.fixture
def engine(dsn: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(sqlalchemy_url(dsn))
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id int PRIMARY KEY)")
    yield engine
    engine.dispose()


def drain(settings: Settings) -> None:
    relay = Relay(settings)
    relay.start()
    relay.run(drain=True)


def committed_rows(dsn: str) -> int:
    """Rows another session can see: what the application has committed."""
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM outbox").fetchone()[0]  # type: ignore[index]


def orders(dsn: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute("SELECT id FROM orders ORDER BY id")]


def test_sqlalchemy__session_commit_publishes_rollback_never_does(
    engine: sa.Engine, settings: Settings, topology: Topology
) -> None:
    with Session(engine) as session:
        session.execute(sa.text("INSERT INTO orders VALUES (1)"))
        kept = outbox_sa.enqueue(
            session, exchange=topology.exchange, routing_key="order.created", payload=b"1"
        )
        assert committed_rows(settings.dsn) == 0  # the helper did not commit
        session.commit()

    with Session(engine) as session:
        session.execute(sa.text("INSERT INTO orders VALUES (2)"))
        outbox_sa.enqueue(
            session, exchange=topology.exchange, routing_key="order.created", payload=b"2"
        )
        session.rollback()

    with pytest.raises(ZeroDivisionError), Session(engine) as session, session.begin():
        session.execute(sa.text("INSERT INTO orders VALUES (3)"))
        outbox_sa.enqueue_json(
            session, exchange=topology.exchange, routing_key="order.created", body={"id": 3}
        )
        raise ZeroDivisionError

    drain(settings)
    [(_, props, body)] = topology.messages()
    assert (props.message_id, body) == (str(kept), b"1")
    assert orders(settings.dsn) == [1]
    assert committed_rows(settings.dsn) == 0


def test_sqlalchemy__core_connection_autobegin_commit_and_rollback(
    engine: sa.Engine, settings: Settings, topology: Topology
) -> None:
    # No explicit begin(): SQLAlchemy must know the helper's statement opened a
    # transaction, or conn.commit() would commit nothing and the row would be lost.
    with engine.connect() as conn:
        first = outbox_sa.enqueue(conn, exchange=topology.exchange, routing_key="a", payload=b"1")
        assert conn.in_transaction()
        conn.commit()
        outbox_sa.enqueue(conn, exchange=topology.exchange, routing_key="b", payload=b"2")
        conn.rollback()
        many = outbox_sa.enqueue_many(
            conn,
            [outbox.OutgoingMessage(topology.exchange, f"c.{i}", b"%d" % i) for i in range(3)],
        )
    # Closing without commit rolls back, as with any SQLAlchemy connection.
    with engine.begin() as conn:
        last = outbox_sa.enqueue(conn, exchange=topology.exchange, routing_key="d", payload=b"4")

    assert len(many) == 3
    drain(settings)
    got = {props.message_id: method.routing_key for method, props, _ in topology.messages()}
    assert got == {str(first): "a", str(last): "d"}


def test_sqlalchemy__row_is_identical_to_plain_sql_and_outbox_enqueue(
    engine: sa.Engine, settings: Settings, topology: Topology
) -> None:
    plain_id, helper_id, core_id, json_id, core_json_id = (uuid.uuid4() for _ in range(5))
    with Session(engine) as session, session.begin():
        session.execute(
            sa.text(
                "INSERT INTO outbox (message_id, exchange, routing_key, payload, headers, "
                "content_type) VALUES (:m, :e, 'k', :p, CAST(:h AS jsonb), 'text/x')"
            ),
            {
                "m": plain_id,
                "e": topology.exchange,
                "p": PAYLOAD,
                "h": '{"tenant": "acmé", "n": 7, "flags": [true, null, "x"], '
                '"nested": {"a": {"b": -1}}}',
            },
        )
        outbox_sa.enqueue(
            session,
            exchange=topology.exchange,
            routing_key="k",
            payload=PAYLOAD,
            headers=HEADERS,
            content_type="text/x",
            message_id=helper_id,
        )
        outbox_sa.enqueue_json(
            session,
            exchange=topology.exchange,
            routing_key="j",
            body={"é": [1]},
            message_id=json_id,
        )
    with psycopg.connect(settings.dsn) as conn:
        outbox.enqueue(
            conn,
            exchange=topology.exchange,
            routing_key="k",
            payload=PAYLOAD,
            headers=HEADERS,
            content_type="text/x",
            message_id=core_id,
        )
        outbox.enqueue_json(
            conn,
            exchange=topology.exchange,
            routing_key="j",
            body={"é": [1]},
            message_id=core_json_id,
        )
        rows = {
            r[0]: r[1:]
            for r in conn.execute(
                "SELECT message_id, exchange, routing_key, payload, headers::text, "
                "content_type FROM outbox"
            )
        }
    assert rows[plain_id] == rows[helper_id] == rows[core_id]
    assert rows[json_id] == rows[core_json_id]
    assert rows[helper_id][2] == PAYLOAD

    drain(settings)
    published = {
        props.message_id: (
            method.exchange,
            method.routing_key,
            props.headers,
            props.content_type,
            body,
        )
        for method, props, body in topology.messages()
    }
    assert published[str(plain_id)] == published[str(helper_id)] == published[str(core_id)]
    assert published[str(json_id)] == published[str(core_json_id)]
    assert published[str(helper_id)][2] == HEADERS


async def _async_flow(engine: AsyncEngine, exchange: str) -> list[uuid.UUID]:
    async with AsyncSession(engine) as session:
        await session.execute(sa.text("INSERT INTO orders VALUES (10)"))
        kept = await outbox_sa.enqueue_async(
            session, exchange=exchange, routing_key="a", payload=b"1"
        )
        kept_json = await outbox_sa.enqueue_json_async(
            session, exchange=exchange, routing_key="b", body=[1]
        )
        await session.commit()
    async with AsyncSession(engine) as session:
        await session.execute(sa.text("INSERT INTO orders VALUES (11)"))
        await outbox_sa.enqueue_async(session, exchange=exchange, routing_key="x", payload=b"2")
        await session.rollback()
    async with AsyncSession(engine) as session, session.begin():
        begun = await outbox_sa.enqueue_async(
            session, exchange=exchange, routing_key="e", payload=b"5"
        )
    async with engine.connect() as conn:
        many = await outbox_sa.enqueue_many_async(
            conn,
            [
                outbox.OutgoingMessage(exchange, "c", b"3"),
                outbox.OutgoingMessage(exchange, "d", b"4"),
            ],
        )
        await conn.commit()
    await engine.dispose()
    return [kept, kept_json, begun, *many]


def test_sqlalchemy__async_session_commit_publishes_rollback_never_does(
    engine: sa.Engine, settings: Settings, topology: Topology
) -> None:
    async_engine = create_async_engine(sqlalchemy_url(settings.dsn))
    kept = asyncio.run(_async_flow(async_engine, topology.exchange))
    drain(settings)
    got = {props.message_id: method.routing_key for method, props, _ in topology.messages()}
    assert got == dict(zip(map(str, kept), ["a", "b", "e", "c", "d"], strict=True))
    assert orders(settings.dsn) == [10]


def test_sqlalchemy__autocommit_connection_is_refused_before_writing(
    engine: sa.Engine, settings: Settings
) -> None:
    with (
        engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn,
        pytest.raises(OutboxError, match="AUTOCOMMIT") as caught,
    ):
        outbox_sa.enqueue(conn, exchange="", routing_key="k", payload=b"1")
    assert "isolation_level" in caught.value.hint
    assert committed_rows(settings.dsn) == 0


def test_sqlalchemy__other_drivers_are_refused_with_a_hint() -> None:
    engine = sa.create_engine("sqlite://")
    with Session(engine) as session, pytest.raises(OutboxError, match="sqlite") as caught:
        outbox_sa.enqueue(session, exchange="", routing_key="k", payload=b"1")
    assert "postgresql+psycopg://" in caught.value.hint


def test_sqlalchemy__enqueue_stores_the_active_spans_traceparent(
    engine: sa.Engine, settings: Settings
) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from tests.fixtures.tracing import recorded_spans, tracer

    recorded_spans()
    with tracer().start_as_current_span("POST /orders") as span, Session(engine) as session:
        outbox_sa.enqueue(session, exchange="", routing_key="k", payload=b"1", headers={"a": 1})
        session.commit()
    with psycopg.connect(settings.dsn) as conn:
        [(headers,)] = conn.execute("SELECT headers FROM outbox").fetchall()
    ctx = span.get_span_context()
    assert headers["a"] == 1
    assert headers["traceparent"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")


def test_sqlalchemy__the_insert_goes_through_sqlalchemys_execution_events(
    engine: sa.Engine,
) -> None:
    """Logging and instrumentation hooked on SQLAlchemy's events see the statement."""
    seen: list[str] = []
    sa.event.listen(
        engine, "before_cursor_execute", lambda conn, cursor, statement, *_: seen.append(statement)
    )
    with Session(engine) as session, session.begin():
        outbox_sa.enqueue(session, exchange="", routing_key="k", payload=b"1")
    assert [s for s in seen if "outbox" in s] == [insert_sql("outbox")]


def test_sqlalchemy__schedules_and_cancels_in_the_sessions_transaction(
    engine: sa.Engine, settings: Settings
) -> None:
    when = datetime.datetime(2100, 1, 1, tzinfo=datetime.timezone.utc)
    with Session(engine) as session, session.begin():
        later = outbox_sa.enqueue(
            session, exchange="e", routing_key="k", payload=b"1", deliver_at=when
        )
        dropped = outbox_sa.enqueue(
            session, exchange="e", routing_key="k", payload=b"2", deliver_at=when
        )
    with Session(engine) as session, session.begin():
        assert outbox_sa.cancel(session, dropped) is True
        assert outbox_sa.cancel(session, dropped) is False

    async def cancel_async() -> bool:
        async_engine = create_async_engine(sqlalchemy_url(settings.dsn))
        try:
            async with AsyncSession(async_engine) as session, session.begin():
                return await outbox_sa.cancel_async(session, uuid.uuid4())
        finally:
            await async_engine.dispose()

    assert asyncio.run(cancel_async()) is False
    with psycopg.connect(settings.dsn) as conn:
        rows = conn.execute("SELECT message_id, deliver_at FROM outbox_scheduled").fetchall()
    assert rows == [(later, when)]
