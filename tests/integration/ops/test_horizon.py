"""What holds the MVCC horizon, as ``outbox status`` and the metrics endpoint name it,
against a real held snapshot, replication slot and prepared transaction."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox.config import Settings
from outbox.db import migrate
from outbox.db.devcluster import PostgresCluster
from outbox.db.horizon import HorizonReader
from outbox.errors import StatementTimedOut
from outbox.ops import status
from outbox.relay.metrics import DatabaseFigures
from outbox.web.app import WebConfig, create_app
from outbox.web.console import ConsoleConfig
from outbox.web.security import Credentials
from tests.unit.web.test_app import call

# A logical slot needs wal_level = logical, which the shared test server has not.
LOGICAL = {"wal_level": "logical", "max_replication_slots": "4", "max_wal_senders": "4"}


@pytest.fixture(scope="module")
def logical_dsn() -> Iterator[str]:
    cluster = PostgresCluster(durable=False, max_prepared_transactions=10, extra_settings=LOGICAL)
    cluster.start()
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox")  # type: ignore[arg-type]
    try:
        yield cluster.dsn
    finally:
        cluster.destroy()


def churn(dsn: str, rows: int) -> None:
    """``rows`` outbox rows inserted and deleted, as a relay leaves them: dead rows."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (payload) SELECT '\\x00' FROM generate_series(1, %s)", [rows]
        )
        conn.execute("DELETE FROM outbox")
        # Statistics reach pg_stat_user_tables when a backend flushes them (about
        # once a second); this one's now.
        conn.execute("SELECT pg_stat_force_next_flush()")


@pytest.fixture
def holders(logical_dsn: str) -> Iterator[dict[str, object]]:
    """A report in REPEATABLE READ that read the outbox (as pg_dump does), a logical
    slot and another application's prepared transaction, then dead rows behind them."""
    report = psycopg.connect(logical_dsn, application_name="nightly-report")
    report.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    report.execute("SELECT count(*) FROM outbox")
    admin = psycopg.connect(logical_dsn, autocommit=True)
    admin.execute("SELECT pg_create_logical_replication_slot('cdc_feed', 'test_decoding')")
    other = psycopg.connect(logical_dsn, autocommit=True)
    other.execute("BEGIN")
    other.execute("SELECT pg_current_xact_id()")
    other.execute("PREPARE TRANSACTION 'billing-42'")
    churn(logical_dsn, 500)
    try:
        yield {"report_pid": report.info.backend_pid}
    finally:
        report.close()
        admin.execute("ROLLBACK PREPARED 'billing-42'")
        admin.execute("SELECT pg_drop_replication_slot('cdc_feed')")
        admin.close()
        other.close()


def settings_for(dsn: str, statement_timeout: float = 30.0) -> Settings:
    return Settings(dsn=dsn, statement_timeout=statement_timeout, lock_timeout=statement_timeout)


def test_status__names_the_session_slot_and_prepared_transaction_holding_the_horizon(
    logical_dsn: str, holders: dict[str, object]
) -> None:
    report = status.collect(settings_for(logical_dsn), max_prepared_age=3600, max_horizon_age=0)
    horizon = report["horizon"]
    by_kind = {h["kind"]: h for h in horizon["holders"]}
    session = by_kind["session"]
    assert (session["pid"], session["application_name"], session["state"]) == (
        holders["report_pid"],
        "nightly-report",
        "idle in transaction",
    )
    assert session["holds_outbox"] and session["xmin_age_xids"] > 0
    slot = by_kind["replication_slot"]
    # A logical slot holds only the system catalogs: not the outbox's dead rows.
    assert (slot["name"], slot["slot_type"], slot["holds_outbox"]) == ("cdc_feed", "logical", False)
    assert slot["catalog_xmin_age_xids"] > 0
    prepared = by_kind["prepared_transaction"]
    assert prepared["name"] == "billing-42" and prepared["holds_outbox"]
    assert horizon["dead_rows"] >= 500 and horizon["table_bytes"] > 0
    assert horizon["age_xids"] > 0 and horizon["age_seconds"] > 0
    # The oldest holder is named, with what to do.
    (problem,) = [p for p in report["attention"] if "horizon" in p]
    assert "holds the MVCC horizon back" in problem and "dead rows" in problem
    text = status.render(report)
    assert "'nightly-report' idle in transaction" in text
    assert "slot 'cdc_feed' (logical, inactive)" in text and "system catalogs only" in text
    assert "prepared 'billing-42'" in text


def test_status__a_young_horizon_needs_no_attention(
    logical_dsn: str, holders: dict[str, object]
) -> None:
    report = status.collect(settings_for(logical_dsn), max_prepared_age=3600, max_horizon_age=600)
    assert not [p for p in report["attention"] if "horizon" in p]


def test_status__nothing_held_reports_no_session(logical_dsn: str) -> None:
    report = status.collect(settings_for(logical_dsn), max_prepared_age=3600, max_horizon_age=0)
    assert report["horizon"]["holders"] == [] and report["horizon"]["age_xids"] == 0
    assert report["attention"] == []


def test_status__waits_for_a_lock_no_longer_than_its_timeout(logical_dsn: str) -> None:
    """A migration or a TRUNCATE holding the outbox's ACCESS EXCLUSIVE lock: status
    (its horizon queries included) gives up after its lock_timeout with a one-line
    error instead of hanging."""
    locker = psycopg.connect(logical_dsn)
    locker.execute("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
    outcome: list[BaseException | dict[str, object]] = []

    def run() -> None:
        try:
            outcome.append(status.collect(settings_for(logical_dsn, 1.0), max_prepared_age=60))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(20)
    locker.close()
    assert not thread.is_alive(), "outbox status waited for the lock with no timeout"
    (result,) = outcome
    assert isinstance(result, StatementTimedOut), result
    assert time.monotonic() - started < 15


def test_metrics__dead_rows_and_horizon_age_while_a_snapshot_is_held(
    logical_dsn: str, holders: dict[str, object]
) -> None:
    figures = DatabaseFigures(logical_dsn, "outbox", connect_timeout=3, ttl=0)
    try:
        figures.refresh()
        assert figures.error is None and figures.figures is not None
        assert figures.figures["dead_rows"] >= 500
        assert figures.figures["horizon_age_seconds"] > 0
        assert figures.figures["horizon_age_xids"] > 0
    finally:
        figures.close()


def test_console__overview_names_the_horizon_holder_and_the_dead_rows(
    logical_dsn: str, holders: dict[str, object]
) -> None:
    config = WebConfig(
        ConsoleConfig((settings_for(logical_dsn),)), "amqp://localhost", Credentials()
    )
    code, body = call(create_app(config), "GET", "/overview/panel", {"host": "127.0.0.1:8310"})
    assert code == 200, body
    text = body.decode()
    assert 'id="horizon-outbox"' in text and "Outbox dead rows: " in text
    assert f"by session <code>pid {holders['report_pid']}</code> (nightly-report, idle in" in text


def test_console__overview_names_a_prepared_transaction_holding_the_horizon(
    logical_dsn: str,
) -> None:
    """A holder without a session (a prepared transaction; a slot alike) renders too."""
    other = psycopg.connect(logical_dsn, autocommit=True)
    other.execute("BEGIN")
    other.execute("SELECT pg_current_xact_id()")
    other.execute("PREPARE TRANSACTION 'billing-43'")
    # A snapshot taken now has the prepared transaction's xid as its xmin: the same
    # age.  The session only follows; the prepared transaction is named.
    follower = psycopg.connect(logical_dsn, autocommit=True)
    follower.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    follower.execute("SELECT 1")
    try:
        config = WebConfig(
            ConsoleConfig((settings_for(logical_dsn),)), "amqp://localhost", Credentials()
        )
        code, body = call(create_app(config), "GET", "/overview/panel", {"host": "127.0.0.1:8310"})
        assert code == 200, body
        assert "by prepared transaction <code>billing-43</code>." in body.decode()
    finally:
        follower.close()
        other.execute("ROLLBACK PREPARED 'billing-43'")
        other.close()


def test_horizon__holders_of_one_xid_age_rank_by_how_long_however_slow_the_reader(
    logical_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot taken just before another transaction's xid is assigned has that xid
    as its xmin: the same age in transactions.  The one that has held it longer (the
    report, 0.1 s before the PREPARE) is named, even when the reader's statements come
    0.3 s apart (a loaded machine): ages from one now(), not one per statement."""
    report = psycopg.connect(logical_dsn, application_name="nightly-report")
    report.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    report.execute("SELECT 1")
    time.sleep(0.1)
    other = psycopg.connect(logical_dsn, autocommit=True)
    other.execute("BEGIN")
    other.execute("SELECT pg_current_xact_id()")
    other.execute("PREPARE TRANSACTION 'billing-44'")
    reader = HorizonReader(logical_dsn, "outbox")
    execute = reader.conn.execute

    def slow(*args: Any, **kwargs: Any) -> Any:
        cursor = execute(*args, **kwargs)
        time.sleep(0.3)
        return cursor

    try:
        monkeypatch.setattr(reader.conn, "execute", slow)
        horizon = reader.horizon()
        by_kind = {h.kind: h for h in horizon.holders}
        session, prepared = by_kind["session"], by_kind["prepared_transaction"]
        assert session.xmin_age_xids == prepared.xmin_age_xids, "the shape needs a tie"
        assert horizon.oldest is session, horizon.holders
        assert session.age_seconds is not None and prepared.age_seconds is not None
        assert 0.05 < session.age_seconds - prepared.age_seconds < 1.0
    finally:
        reader.close()
        report.close()
        other.execute("ROLLBACK PREPARED 'billing-44'")
        other.close()
