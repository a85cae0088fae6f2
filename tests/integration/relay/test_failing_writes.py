"""A relay write that keeps failing costs a bounded number of duplicates (issue 19).

Each of the relay's writes fails for ``FAULT_SECONDS`` (20 s, as the issue asks)
while a relay runs: the claim, PREPARE, the ledger record, COMMIT PREPARED,
ROLLBACK PREPARED and the dead-letter write.  Before the fix, a dead-letter write
failing with an error the relay did not expect (an index row too large, a lock
timeout) rolled the batch back and published its good rows again on every retry,
with the backoff stuck at its first step: 170 copies of each good row in 30 s.

Every test ends with the fault suite's checker: nothing lost, nothing unexpected,
nothing left prepared, duplicates within the bound of docs/explanation/guarantee.md (the batches in
flight: one batch serial, two pipelined; no message more than twice), the
relay drained the table after the fault ended, backed off to its ceiling while
the fault lasted, and said which write failed (log line and metric).

The faults: a real lock held by another session (claim, dead letters), an error
raised by a trigger while a switch row exists (any SQLSTATE: claim, PREPARE
through a deferred constraint trigger, dead letters), the ledger stream deleted,
and the work connection cut whenever it sends COMMIT or ROLLBACK PREPARED.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import re
import secrets
import threading
import time
import uuid
from collections.abc import Iterator

import pika
import psycopg
import pytest

from outbox.config import Settings
from outbox.relay import Relay
from tests.fixtures.faults import (
    TcpProxy,
    both_modes,
    check_delivery,
    in_flight,
    prepared_left,
    proxied_dsn,
    rows_left,
    wait_for,
)
from tests.fixtures.servers import Topology
from tests.integration.db.test_unindexable_values import before_the_limit

FAULT_SECONDS = 20.0
BATCH = 50
PLAIN, KEYED = 100, 100


# -- the rows of the reproduction -------------------------------------------------
@dataclasses.dataclass
class Written:
    good: list[str]  # message ids of the rows that must be delivered
    bad: str  # message id of the unroutable row (a dead letter)


def write_rows(dsn: str, topology: Topology, *, bad_key: str = "bad-key") -> Written:
    """100 plain rows, one unroutable row with ``bad_key``, 100 keyed rows."""
    with psycopg.connect(dsn) as conn:
        plain = conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) "
            "SELECT %s, 'k', convert_to('plain-' || i, 'UTF8') FROM generate_series(1, %s) i "
            "RETURNING message_id",
            [topology.exchange, PLAIN],
        ).fetchall()
        [bad] = conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
            "VALUES ('', %s, 'unroutable', %s) RETURNING message_id",
            [f"nobody.bound.{uuid.uuid4().hex}", bad_key],
        ).fetchall()
        keyed = conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload, ordering_key) "
            "SELECT %s, 'k', convert_to('keyed-' || i, 'UTF8'), 'key-' || (i %% 10) "
            "FROM generate_series(1, %s) i RETURNING message_id",
            [topology.exchange, KEYED],
        ).fetchall()
    return Written([str(r[0]) for r in plain + keyed], str(bad[0]))


def dead_letter_ids(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(r[0]) for r in conn.execute("SELECT message_id FROM outbox_dead_letters")]


# -- faults ---------------------------------------------------------------------------------
INJECTOR = """
CREATE TABLE IF NOT EXISTS test_faults (write text PRIMARY KEY, sqlstate text NOT NULL);
CREATE OR REPLACE FUNCTION test_fault() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    code text;
BEGIN
    SELECT sqlstate INTO code FROM test_faults WHERE write = TG_ARGV[0];
    IF code IS NOT NULL THEN
        RAISE EXCEPTION 'injected fault in the % write', TG_ARGV[0] USING ERRCODE = code;
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS test_fault_claim ON outbox;
CREATE TRIGGER test_fault_claim BEFORE DELETE ON outbox
    FOR EACH ROW EXECUTE FUNCTION test_fault('claim');
-- Deferred: fires when the transaction ends, i.e. at PREPARE TRANSACTION.
DROP TRIGGER IF EXISTS test_fault_prepare ON outbox;
CREATE CONSTRAINT TRIGGER test_fault_prepare AFTER DELETE ON outbox
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_fault('prepare');
DROP TRIGGER IF EXISTS test_fault_dead_letters ON outbox_dead_letters;
CREATE TRIGGER test_fault_dead_letters BEFORE INSERT ON outbox_dead_letters
    FOR EACH ROW EXECUTE FUNCTION test_fault('dead_letters');
"""


@contextlib.contextmanager
def raising(dsn: str, write: str, sqlstate: str) -> Iterator[None]:
    """While inside, the trigger of ``write`` raises an error with ``sqlstate``
    (``INJECTOR`` is installed before the relay starts: CREATE TRIGGER waits for
    the prepared batches' locks)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO test_faults VALUES (%s, %s)", [write, sqlstate])
        try:
            yield
        finally:
            conn.execute("DELETE FROM test_faults WHERE write = %s", [write])


@contextlib.contextmanager
def locked(dsn: str, table: str, mode: str) -> Iterator[None]:
    """While inside, another session holds ``LOCK TABLE table IN mode MODE``."""
    with psycopg.connect(dsn) as conn:
        conn.execute(f"LOCK TABLE {table} IN {mode} MODE")
        try:
            yield
        finally:
            conn.rollback()


@contextlib.contextmanager
def ledger_gone(settings: Settings) -> Iterator[None]:
    """While inside, the ledger stream does not exist: records come back unroutable."""
    params = pika.URLParameters(settings.amqp_url)
    conn = pika.BlockingConnection(params)
    try:
        conn.channel().queue_delete(settings.ledger_queue)
        yield
        conn.channel().queue_declare(
            settings.ledger_queue,
            durable=True,
            arguments={"x-queue-type": "stream", "x-max-age": settings.ledger_max_age},
        )
    finally:
        conn.close()


# -- the relay ------------------------------------------------------------------------------
class RunningRelay:
    """A relay in a thread; the test reads its stats and its log."""

    def __init__(self, settings: Settings) -> None:
        self.relay = Relay(settings)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.relay.start()
            self.relay.run()
        except BaseException as exc:  # a relay must never die of a failing write
            self.error = exc

    def __enter__(self) -> RunningRelay:
        self.thread.start()
        wait_for(lambda: self.relay.relay_id or self.error, 20, "the relay to register")
        return self

    def __exit__(self, *_: object) -> None:
        self.relay.stop.set()
        self.thread.join(timeout=60)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def wait_until_drained(self, dsn: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while rows_left(dsn) or prepared_left(dsn):
            assert self.alive, f"the relay died: {self.error!r}"
            assert time.monotonic() < deadline, (
                f"rows still waiting {timeout}s after the fault ended: {self.relay.stats}"
            )
            time.sleep(0.1)


def fault_settings(settings: Settings, **changes: object) -> Settings:
    return dataclasses.replace(
        settings,
        batch_size=BATCH,
        statement_timeout=1.0,
        backoff_initial=0.05,
        backoff_max=2.0,
        **changes,  # type: ignore[arg-type]
    )


RETRY = re.compile(r"relay\.retry .*?sleep=([\d.]+)s")


def retries(caplog: pytest.LogCaptureFixture) -> list[tuple[str, float]]:
    """(line, sleep) of each relay.retry log line."""
    found = []
    for record in caplog.records:
        match = RETRY.search(record.getMessage())
        if match:
            found.append((record.getMessage(), float(match[1])))
    return found


def run_through_fault(
    settings: Settings,
    topology: Topology,
    caplog: pytest.LogCaptureFixture,
    fault: contextlib.AbstractContextManager[None],
    *,
    write: str,
    seconds: float = FAULT_SECONDS,
    bad_key: str = "bad-key",
    relay_settings: Settings | None = None,
    rows_first: bool = False,
) -> RunningRelay:
    """Start a relay, fail ``write``, write the rows, go on failing for ``seconds``,
    then check that the relay drained the table within the bound and said what
    failed.  ``rows_first``: write the rows, start failing, then start the relay."""
    caplog.set_level(logging.INFO, logger="outbox")
    with psycopg.connect(settings.dsn, autocommit=True) as conn:
        conn.execute(INJECTOR)
    written: Written | None = None
    if rows_first:  # the fault blocks the application's inserts too
        written = write_rows(settings.dsn, topology, bad_key=bad_key)
        fault.__enter__()
    running = RunningRelay(relay_settings or settings).__enter__()
    try:
        if not rows_first:
            fault.__enter__()
            written = write_rows(settings.dsn, topology, bad_key=bad_key)
        try:
            time.sleep(seconds)
            assert running.alive, f"the relay died of a failing {write}: {running.error!r}"
            during = retries(caplog)
        finally:
            fault.__exit__(None, None, None)
        running.wait_until_drained(settings.dsn, timeout=30)
        assert running.alive
    finally:
        running.__exit__()
    assert written is not None
    stats = running.relay.stats

    report = check_delivery(
        settings.dsn, topology, written.good, max_duplicates=in_flight(settings) * BATCH
    )
    worst = max(report.counts.values())
    longest = max((sleep for _, sleep in during), default=0.0)
    print(
        f"{write} failing {seconds:g} s: {report.duplicates} duplicates "
        f"(bound {in_flight(settings) * BATCH}), {stats.write_failures[write]} failures, "
        f"{len(during)} retries, longest backoff {longest:.2f} s"
    )
    assert worst <= 2, f"a message went out {worst} times"
    assert dead_letter_ids(settings.dsn) == [written.bad]
    # The failing write was named, in the log and in the metric's counter.
    assert during, f"the {write} never failed: the fault was not injected"
    assert any(f"write={write}" in line for line, _ in during), during[:3]
    assert stats.write_failures[write] >= 1, stats.write_failures
    # The backoff grew to its ceiling ([max/2, max] with jitter) instead of staying at
    # its first step; stuck at 0.05-0.1 s the relay retried 170 times in 30 s.
    assert longest >= settings.backoff_max / 2, during[-5:]
    return running


# -- one test per write ---------------------------------------------------------------------
@both_modes
def test_dead_letter_write__index_row_too_large__row_ends_as_a_dead_letter_once(
    settings: Settings, topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's first reproduction: an unroutable row whose 3,200-character key did
    not fit the dead letters' B-tree index (8,430 messages for 200 rows in 30 s)."""
    settings = fault_settings(settings)
    caplog.set_level(logging.INFO, logger="outbox")
    with before_the_limit(settings.dsn):  # schema 0004 limits new rows' keys
        written = write_rows(settings.dsn, topology, bad_key=secrets.token_urlsafe(2400))
    with RunningRelay(settings) as running:
        running.wait_until_drained(settings.dsn, timeout=30)
        assert running.alive
    check_delivery(settings.dsn, topology, written.good, max_duplicates=0)
    assert dead_letter_ids(settings.dsn) == [written.bad]
    assert running.relay.stats.batches_rolled_back == 0


@pytest.mark.slow
def test_dead_letter_write__table_locked_20s__publishes_each_row_at_most_twice(
    settings: Settings, topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's second reproduction: LOCK TABLE outbox_dead_letters IN SHARE MODE
    for 20 s, relay with --statement-timeout 1 (984 messages for 200 rows before)."""
    settings = fault_settings(settings)
    fault = locked(settings.dsn, "outbox_dead_letters", "SHARE")
    run_through_fault(settings, topology, caplog, fault, write="dead_letters")


@pytest.mark.parametrize(
    "sqlstate",
    ["54000", "23514", "55P03", "57014", "42501", "XX000"],
    ids=["program-limit", "check", "lock-not-available", "cancelled", "privilege", "internal"],
)
def test_dead_letter_write__any_error__publishes_each_row_at_most_twice(
    sqlstate: str, settings: Settings, topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever the error of the dead-letter INSERT, the same path (shorter faults)."""
    settings = fault_settings(settings)
    fault = raising(settings.dsn, "dead_letters", sqlstate)
    run_through_fault(settings, topology, caplog, fault, write="dead_letters", seconds=6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lock", "error"])
def test_claim__failing_20s__publishes_each_row_at_most_twice(
    kind: str, settings: Settings, topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    settings = fault_settings(settings)
    fault = (
        locked(settings.dsn, "outbox", "SHARE")
        if kind == "lock"
        else raising(settings.dsn, "claim", "XX000")
    )
    run_through_fault(settings, topology, caplog, fault, write="claim", rows_first=True)


@pytest.mark.slow
def test_prepare__failing_20s__publishes_each_row_at_most_twice(
    settings: Settings, topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    settings = fault_settings(settings)
    fault = raising(settings.dsn, "prepare", "XX000")
    run_through_fault(settings, topology, caplog, fault, write="prepare")


@pytest.mark.slow
def test_ledger_record__failing_20s__publishes_each_row_at_most_twice(
    settings: Settings, topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    settings = fault_settings(settings)
    run_through_fault(settings, topology, caplog, ledger_gone(settings), write="ledger")


@contextlib.contextmanager
def cutting(proxy: TcpProxy, statement: bytes) -> Iterator[None]:
    """While inside, every connection that sends ``statement`` is cut before it runs."""
    proxy.arm(statement, persistent=True)
    try:
        yield
    finally:
        proxy.disarm()


@pytest.mark.slow
def test_commit_prepared__failing_20s__publishes_each_row_at_most_twice(
    settings: Settings, topology: Topology, caplog: pytest.LogCaptureFixture, pg_proxy: TcpProxy
) -> None:
    settings = fault_settings(settings)
    relay_settings = dataclasses.replace(settings, dsn=proxied_dsn(settings.dsn, pg_proxy))
    fault = cutting(pg_proxy, b"COMMIT PREPARED")
    run_through_fault(
        settings, topology, caplog, fault, write="commit_prepared", relay_settings=relay_settings
    )


@pytest.mark.slow
def test_rollback_prepared__failing_20s__publishes_each_row_at_most_twice(
    settings: Settings, topology: Topology, caplog: pytest.LogCaptureFixture, pg_proxy: TcpProxy
) -> None:
    """Rollbacks are what the dead-letter table's lock causes; they are cut too."""
    settings = fault_settings(settings)
    relay_settings = dataclasses.replace(settings, dsn=proxied_dsn(settings.dsn, pg_proxy))

    @contextlib.contextmanager
    def fault() -> Iterator[None]:
        with (
            raising(settings.dsn, "dead_letters", "XX000"),
            cutting(pg_proxy, b"ROLLBACK PREPARED"),
        ):
            yield

    run_through_fault(
        settings,
        topology,
        caplog,
        fault(),
        write="rollback_prepared",
        relay_settings=relay_settings,
    )


def test_write_failures__counted_by_write_in_the_metric() -> None:
    """``outbox_write_failures_total{write=…}`` exports ``Stats.write_failures``."""
    from outbox.relay.metrics import RelayCollector
    from outbox.relay.stats import Stats

    class Figures:
        figures = None

        def refresh(self) -> None:
            pass

    class FakeRelay:
        stats = Stats(write_failures=collections.Counter({"dead_letters": 3, "claim": 1}))

        class publisher:
            connected = True

    collector = RelayCollector(FakeRelay(), Figures(), database_name="d")  # type: ignore[arg-type]
    [family] = [m for m in collector.collect() if m.name == "outbox_write_failures"]
    assert {s.labels["write"]: s.value for s in family.samples if s.name.endswith("_total")} == {
        "dead_letters": 3,
        "claim": 1,
    }
