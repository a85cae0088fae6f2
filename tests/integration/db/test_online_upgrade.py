"""``outbox init`` upgrades a schema online (issue 19, item 3).

The reproductions of the issue, on a database at schema 1 (made by release 0.1.0's
own ``outbox init``) holding one prepared batch of a relay that died:

- the current ``outbox init`` used to wait on ``ALTER TABLE outbox`` with no
  ``lock_timeout``, and every application INSERT queued behind it (70 s and
  counting): now it resolves the dead relay's batch first and no INSERT waits
  more than about a second;
- when it cannot settle the batch (here: the broker, which holds the evidence, is
  unreachable) it retries under ``lock_timeout``, says which gid it waits for and
  what settles it, while the application's INSERTs go on;
- a killed ``outbox init`` used to leave its backend in the lock queue, with the
  INSERTs behind it: now the server notices the dead client and lets go.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from outbox.config import Settings
from outbox.db import migrate
from tests.fixtures.application import Application
from tests.fixtures.faults import prepared_left, rows_left, wait_for
from tests.fixtures.releases import extract, relays, release, release_trees, run_release
from tests.fixtures.servers import Topology, run_cli, settings_env

__all__ = ["release_trees"]  # the fixture, used by name

# The bound: no application INSERT waits more than about 1 s while init runs.
# `outbox init` waits at most its lock_timeout (0.5 s) for a lock; the rest is margin
# for a loaded 2-core machine.
INSERT_BOUND = 1.5

UNREACHABLE_AMQP = "amqp://guest:guest@127.0.0.1:9/%2F"


def schema_version(dsn: str) -> int | None:
    with psycopg.connect(dsn) as conn:
        return migrate.current_version(conn, "outbox")  # type: ignore[arg-type]


def declare_ledger(topology: Topology) -> None:
    channel = topology.channel()
    channel.queue_declare(topology.ledger, durable=True, arguments={"x-queue-type": "stream"})
    channel.connection.close()


def dead_relays_batch(dsn: str, rows: int) -> str:
    """Claim and prepare ``rows`` rows as a relay does, then let that relay be gone:
    no control session holds its lock, its gid is in no ledger."""
    gid = f"obx:outbox:{secrets.token_hex(16)}:1"
    conn = psycopg.connect(dsn)
    conn.execute(
        "DELETE FROM outbox WHERE id = ANY(ARRAY(SELECT id FROM outbox ORDER BY id LIMIT %s))",
        [rows],
    )
    conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    conn.close()
    return gid


def finish_prepared(dsn: str) -> None:
    """Roll back what a test left prepared (a database with one cannot be dropped)."""
    for gid in prepared_left(dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


@pytest.fixture
def schema_1(empty_dsn: str, release_trees: pathlib.Path) -> Iterator[str]:
    """A database that release 0.1.0's ``outbox init`` created (schema 1), 20 rows in it."""
    tree = extract(release("0.1.0"), release_trees)
    done = run_release(tree, "init", env=settings_env(Settings(dsn=empty_dsn)))
    assert done.returncode == 0, done.stderr
    assert schema_version(empty_dsn) == 1
    with psycopg.connect(empty_dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) "
            "SELECT 'before', 'k', convert_to(i::text, 'UTF8') FROM generate_series(1, 20) i"
        )
    yield empty_dsn
    finish_prepared(empty_dsn)


class Init:
    """The current ``outbox init`` as a subprocess, its output read as it comes."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        script = os.path.join(os.path.dirname(sys.executable), "outbox")
        self.process = subprocess.Popen(
            [script, "init", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            pytest.fail(f"outbox init did not finish within {timeout}s; it said:\n{self.output}")
        self._reader.join(timeout=5)
        return code

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def init_process() -> Iterator[list[Init]]:
    started: list[Init] = []
    yield started
    for init in started:
        init.close()


def init_backends(dsn: str, *, waiting: bool = False) -> list[int]:
    """Backends of `outbox init` on this database (only those waiting for a lock)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [
            int(row[0])
            for row in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND application_name = 'outbox-init'"
                " AND (NOT %s OR wait_event_type = 'Lock')",
                [waiting],
            ).fetchall()
        ]


def timed_insert(dsn: str, timeout: float = 10.0) -> float:
    """Seconds one application INSERT takes (bounded by ``timeout``)."""
    started = time.monotonic()
    with psycopg.connect(dsn) as conn:
        conn.execute(f"SET statement_timeout = {int(timeout * 1000)}")
        conn.execute("INSERT INTO outbox (exchange, routing_key) VALUES ('after', 'k')")
    return time.monotonic() - started


def test_init__resolves_a_dead_relays_batch_and_never_freezes_inserts(
    schema_1: str, topology: Topology
) -> None:
    declare_ledger(topology)
    gid = dead_relays_batch(schema_1, rows=5)
    env = settings_env(
        Settings(dsn=schema_1, amqp_url=topology.amqp_url, ledger_queue=topology.ledger)
    )
    with Application(schema_1, "app", statement_timeout=10) as app:
        app.wait_for_rows(20)
        started = time.monotonic()
        try:
            done = run_cli("init", env=env, timeout=40)
        except subprocess.TimeoutExpired:
            done = None
        finished = time.monotonic()
        time.sleep(0.2)
    slowest = app.slowest(started, finished)
    print(f"slowest INSERT while outbox init ran: {slowest:.3f}s ({len(app.writes)} writes)")
    assert done is not None, "outbox init still waited after 40 s"
    assert done.returncode == 0, done.stdout + done.stderr
    assert slowest < INSERT_BOUND, f"an INSERT waited {slowest:.1f}s behind outbox init"
    assert not app.errors, app.errors[:3]
    assert schema_version(schema_1) == migrate.LATEST_VERSION
    assert prepared_left(schema_1) == []
    # No ledger record: rolled back, so its 5 rows are back, nothing lost.
    assert rows_left(schema_1) == 20 + len(app.committed)
    assert gid in done.stdout + done.stderr


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_init__says_which_batch_it_waits_for_while_inserts_go_on(
    schema_1: str, init_process: list[Init], log_format: str
) -> None:
    gid = dead_relays_batch(schema_1, rows=5)
    # The ledger is unreachable: init cannot tell whether the batch may be
    # committed, so it must wait for it without holding the application up.
    env = settings_env(Settings(dsn=schema_1, amqp_url=UNREACHABLE_AMQP, connect_timeout=2))
    with Application(schema_1, "app", statement_timeout=10) as app:
        app.wait_for_rows(20)
        started = time.monotonic()
        init = Init(env, "--log-format", log_format)
        init_process.append(init)
        wait_for(lambda: any(gid in line for line in init.lines), 20, f"a line naming {gid}")
        time.sleep(2)  # a few more lock timeouts and retries
        waited = time.monotonic()
        with psycopg.connect(schema_1, autocommit=True) as conn:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        assert init.wait(timeout=20) == 0, init.output
        app.wait_for_rows(len(app.writes) + 20)
    slowest = app.slowest(started, waited)
    print(f"slowest INSERT while outbox init waited: {slowest:.3f}s; init said:\n{init.output}")
    assert slowest < INSERT_BOUND, f"an INSERT waited {slowest:.1f}s behind outbox init"
    assert not app.errors, app.errors[:3]
    waiting = next(line for line in init.lines if gid in line)
    if log_format == "json":
        entry = json.loads(waiting)
        assert entry["event"] == "init.progress", entry
        waiting = entry["message"]
    assert "outbox resolve" in waiting and "relay" in waiting, waiting
    assert schema_version(schema_1) == migrate.LATEST_VERSION


def test_init__killed_while_waiting_leaves_no_backend_in_the_lock_queue(
    schema_1: str, init_process: list[Init]
) -> None:
    dead_relays_batch(schema_1, rows=5)
    env = settings_env(Settings(dsn=schema_1, amqp_url=UNREACHABLE_AMQP, connect_timeout=2))
    init = Init(env)
    init_process.append(init)
    wait_for(lambda: init_backends(schema_1, waiting=True), 20, "outbox init waiting for a lock")
    init.process.send_signal(signal.SIGKILL)
    init.process.wait()
    killed = time.monotonic()
    deadline = killed + 6
    while init_backends(schema_1) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = init_backends(schema_1)
    gone_after = time.monotonic() - killed
    assert not left, f"the killed outbox init's backend {left} still waits in the lock queue"
    insert = timed_insert(schema_1)
    print(f"killed init's backend gone after {gone_after:.2f}s; an INSERT then took {insert:.3f}s")
    assert insert < INSERT_BOUND


def test_init__takes_its_locks_while_pipelined_relays_drain_a_backlog(
    empty_dsn: str, topology: Topology, release_trees: pathlib.Path
) -> None:
    """Relays of release 0.2.0 (pipelined: each claims its next batch before it
    commits the one in flight) drain a backlog while the current init adds a column
    to the outbox.  Queued behind the ALTER, a relay's next claim cannot return, so
    its batch in flight, which the ALTER waits for, is never committed: the old
    init froze the application until the relays' own 30 s lock timeout."""
    tree = extract(release("0.2.0"), release_trees)
    settings = Settings(
        dsn=empty_dsn,
        amqp_url=topology.amqp_url,
        ledger_queue=topology.ledger,
        batch_size=100,
        poll_interval=0.5,
        heartbeat_interval=0.5,
        resolve_interval=1.0,
    )
    env = settings_env(settings)
    assert run_release(tree, "init", env=env).returncode == 0
    with psycopg.connect(empty_dsn) as conn:
        conn.execute(
            "INSERT INTO outbox (exchange, routing_key, payload) "
            "SELECT %s, 'k', convert_to(i::text, 'UTF8') FROM generate_series(1, 60000) i",
            [topology.exchange],
        )
    with (
        Application(empty_dsn, topology.exchange, statement_timeout=10) as app,
        relays(tree, settings, 2) as old_relays,
    ):
        wait_for(lambda: rows_left(empty_dsn) < 59000, 30, "the relays to start draining")
        started = time.monotonic()
        done = run_cli("init", env=env, timeout=60)
        took = time.monotonic() - started
        backlog = rows_left(empty_dsn)
        time.sleep(0.2)
        for relay in old_relays:
            relay.stop()
    slowest = app.slowest(started, started + took)
    print(
        f"init took {took:.2f}s beside draining relays ({backlog} rows still to drain); "
        f"slowest INSERT {slowest:.3f}s\n{done.stderr}"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # Not held up until the relays ran out of work (the old init waited for that, or
    # for their lock timeout; without cancelling their claims, so did this one).
    assert backlog > 0, "outbox init took its lock only once the relays had drained the outbox"
    assert slowest < INSERT_BOUND, f"an INSERT waited {slowest:.1f}s behind outbox init"
    assert not app.errors, app.errors[:3]
    assert prepared_left(empty_dsn) == []


def test_migrate__rebuilds_an_index_a_killed_concurrent_build_left_invalid(
    empty_dsn: str,
) -> None:
    """A killed CREATE INDEX CONCURRENTLY leaves an invalid index that IF NOT EXISTS
    would keep for good: the next init drops it and builds it again."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", target=2)  # type: ignore[arg-type]
        conn.execute("ALTER TABLE outbox ADD COLUMN ordering_key text")
        conn.execute("CREATE INDEX outbox_ordering_key ON outbox (id)")  # as if half built
        conn.execute(
            "UPDATE pg_index SET indisvalid = false"
            " WHERE indexrelid = 'outbox_ordering_key'::regclass"
        )
        assert migrate.migrate(conn, "outbox") == (2, migrate.LATEST_VERSION)  # type: ignore[arg-type]
        row = conn.execute(
            "SELECT i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i"
            " WHERE i.indexrelid = 'outbox_ordering_key'::regclass"
        ).fetchone()
    assert row is not None
    valid, definition = row
    assert valid and "WHERE (ordering_key IS NOT NULL)" in definition, definition


def test_migrate__names_a_session_that_holds_the_outbox_and_goes_on_once_it_ends(
    empty_dsn: str,
) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", target=2)  # type: ignore[arg-type]
    holder = psycopg.connect(empty_dsn, application_name="a-long-report")
    holder.execute("SELECT count(*) FROM outbox")  # ACCESS SHARE, kept: idle in transaction
    pid = holder.info.backend_pid
    waits: list[migrate.Blocked] = []

    def blocked(wait: migrate.Blocked) -> None:
        waits.append(wait)
        if wait.waited > 2:
            holder.rollback()

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert migrate.migrate(conn, "outbox", on_blocked=blocked) == (
            2,
            migrate.LATEST_VERSION,
        )  # type: ignore[arg-type]
    holder.close()
    named = [w for w in waits if any(h.pid == pid for h in w.holders)]
    assert named, [migrate.describe_wait(w, "outbox") for w in waits]
    line = migrate.describe_wait(named[-1], "outbox")
    assert f"session pid {pid} (a-long-report, idle in transaction" in line, line
    assert waits[0].step == "migration 0003_ordering_keys.sql"


def test_migrate__names_another_init_that_holds_the_migration_lock(empty_dsn: str) -> None:
    """The lock-holders statement (``session.LOCK_HOLDERS``, shared with the consumer's
    schema step and the lock timeouts' errors) finds the holder of an advisory lock:
    another ``outbox init`` in its transaction, by pid and name."""
    other = psycopg.connect(empty_dsn, application_name="outbox-init-elsewhere")
    other.execute("SELECT pg_advisory_xact_lock(%s, %s)", migrate._lock_key("outbox"))
    pid = other.info.backend_pid
    waits: list[migrate.Blocked] = []

    def blocked(wait: migrate.Blocked) -> None:
        waits.append(wait)
        other.rollback()  # the other init is done

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", on_blocked=blocked)  # type: ignore[arg-type]
    other.close()
    assert waits, "the migration never waited for the lock the other init held"
    (holder,) = waits[0].holders
    assert (holder.relation, holder.pid, holder.application_name) == (
        "the migration lock",
        pid,
        "outbox-init-elsewhere",
    )


def test_migrate__gives_the_connection_its_own_settings_back(empty_dsn: str) -> None:
    """Django lends its connection: its timeouts must be its own again afterwards."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '7s'")
        conn.execute("SET statement_timeout = '8s'")
        migrate.migrate(conn, "outbox")  # type: ignore[arg-type]
        row = conn.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'),"
            " current_setting('client_connection_check_interval')"
        ).fetchone()
    assert row == ("7s", "8s", "0")


class Waiter:
    """A statement run on its own connection in a thread, its outcome kept."""

    def __init__(self, dsn: str, application_name: str, statement: str) -> None:
        self.conn = psycopg.connect(dsn, application_name=application_name, autocommit=True)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(statement,), daemon=True)
        self.thread.start()

    def _run(self, statement: str) -> None:
        try:
            self.conn.execute(statement)  # type: ignore[arg-type]
        except psycopg.Error as exc:
            self.error = exc
        finally:
            self.done.set()
            self.conn.close()


def migrate_in_thread(dsn: str, waits: list[migrate.Blocked]) -> threading.Thread:
    def run() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate.migrate(conn, "outbox", on_blocked=waits.append)  # type: ignore[arg-type]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_migrate__cancels_relay_claims_queued_behind_its_step_never_the_applications(
    empty_dsn: str,
) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", target=2)  # type: ignore[arg-type]
    holder = psycopg.connect(empty_dsn, application_name="a-long-report")
    holder.execute("SELECT count(*) FROM outbox")  # keeps ACCESS SHARE
    waits: list[migrate.Blocked] = []
    migration = migrate_in_thread(empty_dsn, waits)
    wait_for(lambda: init_backends_waiting(empty_dsn), 10, "the migration waiting for its lock")
    claim = Waiter(empty_dsn, "outbox-relay", "DELETE FROM outbox WHERE id = -1")
    application = Waiter(empty_dsn, "the-application", "INSERT INTO outbox DEFAULT VALUES")
    assert claim.done.wait(5), "the relay's claim queued behind the migration was not cancelled"
    assert isinstance(claim.error, psycopg.errors.QueryCanceled), claim.error
    assert application.done.wait(5)
    assert application.error is None, application.error  # waited, never cancelled
    holder.rollback()
    holder.close()
    migration.join(timeout=20)
    assert not migration.is_alive()
    assert schema_version(empty_dsn) == migrate.LATEST_VERSION
    assert any(w.relay_claims_cancelled for w in waits) or not waits


def init_backends_waiting(dsn: str) -> bool:
    """A backend of this test's process (no application_name) waiting for a lock."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND wait_event_type = 'Lock' AND query LIKE '%%ALTER TABLE%%'"
        ).fetchone()
    return bool(row and row[0])


def test_migrate__says_when_it_may_not_cancel_the_relays_claims(
    empty_dsn: str, pg_server: str
) -> None:
    """An init whose role may not cancel the relays' backends still finishes (each try
    ends at its lock_timeout) and says what right it lacks."""
    role = f"owner_{secrets.token_hex(4)}"
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT CREATE ON SCHEMA public TO {}").format(sql.Identifier(role)))
    owner_dsn = psycopg.conninfo.make_conninfo(empty_dsn, user=role)
    holder = psycopg.connect(empty_dsn, application_name="a-long-report", autocommit=True)
    try:
        with psycopg.connect(owner_dsn, autocommit=True) as conn:
            migrate.migrate(conn, "outbox", target=2)  # type: ignore[arg-type]
        holder.execute("BEGIN")
        holder.execute("SELECT count(*) FROM outbox")
        waits: list[migrate.Blocked] = []
        migration = migrate_in_thread(owner_dsn, waits)
        wait_for(lambda: init_backends_waiting(empty_dsn), 10, "the migration waiting")
        # The relay runs as the superuser: the tables' owner may not cancel it.
        claim = Waiter(empty_dsn, "outbox-relay", "DELETE FROM outbox WHERE id = -1")
        wait_for(lambda: any(w.relay_claims_refused for w in waits), 15, "a refused cancel")
        holder.execute("ROLLBACK")
        migration.join(timeout=20)
        assert not migration.is_alive()
        assert claim.done.wait(5) and claim.error is None
        line = migrate.describe_wait(next(w for w in waits if w.relay_claims_refused), "outbox")
        assert "may not cancel the claims of relays running as 'postgres'" in line, line
        assert "GRANT pg_signal_backend" in line, line
    finally:
        holder.close()
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                [role],
            )
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def test_migrate__an_index_build_names_the_old_transaction_it_waits_for(empty_dsn: str) -> None:
    """CREATE INDEX CONCURRENTLY blocks no INSERT but waits for every transaction that
    started before it, whatever table it reads: that transaction is named."""
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", target=2)  # type: ignore[arg-type]
    # Older, but not waited for: idle in a READ COMMITTED transaction that holds no
    # snapshot and no lock on the outbox's tables (a pooled connection left so).
    idle = psycopg.connect(empty_dsn, application_name="an-idle-pool")
    idle.execute("SELECT count(*) FROM pg_class")
    time.sleep(0.1)
    report = psycopg.connect(empty_dsn, application_name="a-long-report")
    report.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    report.execute("SELECT count(*) FROM pg_class")  # a snapshot, no lock on our tables
    pid = report.info.backend_pid
    waits: list[migrate.Blocked] = []

    def blocked(wait: migrate.Blocked) -> None:
        waits.append(wait)
        assert timed_insert(empty_dsn) < INSERT_BOUND  # the build blocks no INSERT
        report.rollback()

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        result = migrate.migrate(conn, "outbox", on_blocked=blocked)  # type: ignore[arg-type]
    report.close()
    idle.close()
    assert result == (2, migrate.LATEST_VERSION)
    [wait] = waits
    assert wait.step == "migration 0003_ordering_keys.sql: index outbox_ordering_key", wait
    line = migrate.describe_wait(wait, "outbox")
    assert f"session pid {pid} (a-long-report, idle in transaction" in line, line
    assert "an-idle-pool" not in line, line


def test_migrate__names_the_other_init_it_waits_for_and_only_that(empty_dsn: str) -> None:
    # Two `outbox init` at once: the second waits on the migration's advisory lock,
    # which the first holds between short statements.  Its line said only sessions
    # with an old transaction (here an unrelated report on the outbox), never the
    # init it waits for.
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", target=2)  # type: ignore[arg-type]
    report = psycopg.connect(empty_dsn, application_name="a-long-report")
    report.execute("SELECT count(*) FROM outbox")  # idle in transaction
    first = psycopg.connect(empty_dsn, autocommit=True, application_name="outbox-init")
    key = [migrate.MIGRATION_LOCK_CLASS, zlib.crc32(b"outbox") & 0x7FFFFFFF]
    first.execute("SELECT pg_advisory_lock(%s, %s)", key)
    first_pid = first.info.backend_pid
    time.sleep(2 * migrate.LOCK_TIMEOUT)  # the report's transaction is old enough to show
    waits: list[migrate.Blocked] = []

    def blocked(wait: migrate.Blocked) -> None:
        waits.append(wait)
        if len(waits) == 2:
            first.close()
            report.close()

    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate.migrate(conn, "outbox", on_blocked=blocked)  # type: ignore[arg-type]
    line = migrate.describe_wait(waits[0], "outbox")
    assert waits[0].step == "waiting for another outbox init to finish", line
    assert f"to finish: waiting for another outbox init (pid {first_pid}, outbox-init)" in line
    assert "a-long-report" not in line, line
