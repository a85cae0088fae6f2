"""Adversarial tests, second round, of the fixes for the operator tools: the client
deadline of operator sessions (``outbox.db.session.DeadlineConnection``), the console's
``Calls``, the lazy ``outbox`` package and the Ctrl-C entry point (``outbox.entry``),
``parked retry``'s broker answers.

Each test states the shape it tries and, where the fixes fell short, what went wrong
("What happened"): six shapes failed when this round was written and pass since.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import psycopg
import pytest

from outbox.config import Settings
from outbox.db import migrate
from outbox.db.devcluster import PostgresCluster
from outbox.web.app import WebConfig
from outbox.web.console import ConsoleConfig, InboxTarget
from outbox.web.security import Credentials
from tests.fixtures.faults import TcpProxy, proxied_dsn, wait_for
from tests.fixtures.servers import Topology, outbox_command, run_cli
from tests.fixtures.web import create_inbox, start_console
from tests.integration.ops.test_tools_adversary import (
    INBOX,
    cli_env,
    count,
    inbox_dsn,
    insert_parked,
    interrupted_while_loading,
    pg_host_port,
    stalling_proxy,
    started,
    still_running_after,
)


def _run_interrupted_when(
    args: list[str], env: dict[str, str], ready: object, delay: float
) -> tuple[int, str, str]:
    proc = subprocess.Popen(
        [*outbox_command(), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(ready, what="the command to reach the moment")  # type: ignore[arg-type]
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return proc.returncode, out, err


__all__ = ["inbox_dsn"]  # the fixture


@pytest.mark.parametrize(
    ("args", "stall_at", "log_format"),
    [
        (["parked", "list"], b"to_regclass", "text"),
        (["parked", "list"], b"to_regclass", "json"),
        (["dead-letters", "list", "--log-format", "json"], b"_dead_letters", "json"),
    ],
    ids=["parked-text", "parked-json", "dead-letters-json"],
)
def test_ctrl_c_while_postgresql_is_silent_is_one_line_and_exit_130(
    inbox_dsn: str, args: list[str], stall_at: bytes, log_format: str
) -> None:
    """Shape: ``parked list`` / ``dead-letters list`` (statement timeout 1 s: a 3 s
    client deadline) whose PostgreSQL stops answering at an early statement; the
    operator presses Ctrl-C 1.5 s into the silence, before the deadline.  It must end
    with one line (one JSON object with JSON logs) and exit 130, as a Ctrl-C at any
    moment does.  What happened: exit 130, but stderr also carries psycopg's own
    logger line ``query cancellation interrupted (_Silence): closing connection``
    (plain text, even with JSON logs): psycopg's ``Connection.wait`` cancels on
    KeyboardInterrupt and waits again (5 s at most) on the same generator, which
    ``DeadlineConnection._heard`` wraps, so the deadline's private ``_Silence`` fires
    inside psycopg's handler, which logs it and closes the connection; the CLI leaves
    the ``psycopg`` logger's warnings to Python's last-resort handler (an interrupt
    earlier in a longer deadline gets psycopg's "query not terminated after
    cancellation" line the same way)."""
    host, port = pg_host_port(inbox_dsn)
    with stalling_proxy(host, port, stall_at) as proxy:
        env = {**cli_env(proxied_dsn(inbox_dsn, proxy)), "OUTBOX_LOG_FORMAT": log_format}
        code, _out, err = _run_interrupted_when(
            args,
            env,
            lambda: proxy.stalled,
            delay=1.5,
        )
    assert code == 130, (code, err)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("  hint:")]
    if log_format == "json":
        assert len(lines) == 1, err
        assert "interrupted" in json.loads(lines[0])["error"], err
    else:
        assert len(lines) == 1 and lines[0].startswith("error: interrupted"), err


def test_ctrl_c_while_the_cli_loads_is_one_json_object_with_json_logs(inbox_dsn: str) -> None:
    """Shape: ``outbox parked list`` with ``OUTBOX_LOG_FORMAT=json`` sent SIGINT while
    the command line still loads (just after ``outbox.entry`` is imported, told by
    PYTHONPROFILEIMPORTTIME).  Every error must be one JSON object with JSON logs, as
    ``cli.main`` reports the same interrupt a moment later.  What happened: exit 130
    with the plain line ``error: interrupted (Ctrl-C) before the command started``:
    ``outbox.entry._while_loading`` writes text without looking at the log format
    (``cli.common.wants_json``: the argument or the environment variable)."""
    code, err = interrupted_while_loading(
        {**cli_env(inbox_dsn), "OUTBOX_LOG_FORMAT": "json"}, lambda module: module == "outbox.entry"
    )
    lines = [ln for ln in err if ln.strip()]
    assert code == 130, (code, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith("{"), lines
    assert json.loads(lines[0])["exit_code"] == 130, lines


def test_parked_purge__a_commit_waiting_for_a_synchronous_standby_is_named() -> None:
    """Shape: ``parked purge --all`` (statement timeout 1 s) on a live PostgreSQL whose
    ``synchronous_standby_names`` names a standby that is down: the DELETE's commit
    waits for it, which ``statement_timeout`` does not bound.  The server answers every
    other session; the command should say what its statement waits for (a synchronous
    standby), or leave the server's answer to win.  What happened: after the client
    deadline (3 s), exit 3 with "PostgreSQL did not answer while ... the connection was
    closed" and the hint to look for "a stopped server or backend, or a network path
    that drops traffic": the wrong place to look; and the purge did commit (the rows
    are gone once the backend sees the client left).  ``DeadlineConnection`` counts the
    sync-rep wait as silence, which ``connect``'s docstring grants the relay and the
    consumer, not the operator tools."""
    cluster = PostgresCluster(durable=False, max_prepared_transactions=10)
    cluster.start()
    try:
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            migrate.migrate(conn, "outbox")  # type: ignore[arg-type]
        create_inbox(cluster.dsn, INBOX)
        insert_parked(cluster.dsn, "q", 3)
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'absent_standby'")
            conn.execute("SELECT pg_reload_conf()")
        time.sleep(0.5)
        done = run_cli("parked", "purge", "--all", env=cli_env(cluster.dsn), timeout=60)
        with psycopg.connect(cluster.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
            conn.execute("SELECT pg_reload_conf()")
    finally:
        cluster.destroy()
    assert done.returncode != 0, done.stderr  # the purge cannot be confirmed
    assert done.returncode == 6, done.stderr  # waited too long (for the standby)
    assert "Traceback" not in done.stderr
    err = done.stderr.lower()
    assert "standby" in err or "synchronous" in err, done.stderr
    assert "network path" not in err, done.stderr


def test_parked_retry__nacked_returned_and_confirmed_in_one_page(
    inbox_dsn: str, topology: Topology
) -> None:
    """Shape: one page of ``parked retry --all`` mixing three answers: three messages
    for a queue of ``x-max-length`` 1 with ``x-overflow: reject-publish`` (the broker
    confirms the first and nacks the rest), one for a queue since deleted (returned,
    NO_ROUTE), two for a queue that takes them.  Exactly what the broker confirmed
    leaves the parked table; the rest stays parked, exit non-zero, no traceback."""
    full = f"test.full.{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.URLParameters(topology.amqp_url))
    try:
        channel = conn.channel()
        channel.queue_declare(full, arguments={"x-max-length": 1, "x-overflow": "reject-publish"})
        insert_parked(inbox_dsn, full, 3, message_id="'full' || i")
        insert_parked(inbox_dsn, f"gone.{uuid.uuid4().hex[:8]}", 1, message_id="'gone' || i")
        insert_parked(inbox_dsn, topology.queue, 2, message_id="'good' || i")
        done = run_cli(
            "parked", "retry", "--all", env=cli_env(inbox_dsn, topology.amqp_url), timeout=60
        )
        in_full = channel.queue_declare(full, passive=True).method.message_count
        channel.queue_delete(full)
    finally:
        conn.close()
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 1, (done.returncode, done.stderr)
    arrived = sorted(props.message_id for _method, props, _body in topology.messages())
    assert arrived == ["good1", "good2"], (arrived, done.stderr)
    assert in_full == 1
    with psycopg.connect(inbox_dsn, autocommit=True) as db:
        left = sorted(
            str(r[0]) for r in db.execute(f"SELECT message_id FROM {INBOX}_parked").fetchall()
        )
    assert len(left) == 3 and "gone1" in left, (left, done.stderr)
    assert count(inbox_dsn, f"SELECT count(*) FROM {INBOX}_parked WHERE queue = '{full}'") == 2


class TricklingProxy(TcpProxy):
    """Forwards each connection until its client sends ``pattern``; from then on the
    server's bytes on that connection reach the client one every ``gap`` seconds: a
    path (or a server) that still sends something, never enough to finish."""

    def __init__(self, host: str, port: int, pattern: bytes, gap: float) -> None:
        self.trickle_pattern = pattern
        self.gap = gap
        self.trickling: set[int] = set()
        super().__init__(host, port)

    def _upstream(self, pair: Any) -> None:
        with contextlib.suppress(OSError):
            while data := pair.client.recv(65536):
                if self.trickle_pattern in data:
                    self.trickling.add(id(pair))
                pair.server.sendall(data)
        pair.cut()

    def _downstream(self, pair: Any) -> None:
        with contextlib.suppress(OSError):
            while data := pair.server.recv(65536):
                if id(pair) not in self.trickling:
                    pair.client.sendall(data)
                    continue
                for byte in data:
                    time.sleep(self.gap)
                    if self._closed:
                        return
                    pair.client.sendall(bytes([byte]))
        pair.cut()


@contextlib.contextmanager
def trickling_proxy(host: str, port: int, pattern: bytes, gap: float) -> Iterator[TricklingProxy]:
    proxy = TricklingProxy(host, port, pattern, gap)
    try:
        yield proxy
    finally:
        proxy.close()


def test_parked_list__a_postgresql_answer_that_trickles_does_not_hang_it(
    inbox_dsn: str,
) -> None:
    """Shape: ``parked list`` (statement timeout 1 s: a 3 s client deadline) whose
    path to PostgreSQL, from its first statement on, hands the server's answer over
    one byte a second (a degraded link, a proxy dribbling; the answer of that
    statement is about 80 bytes).  The server answered within its statement timeout;
    the command must still end within a generous 9 s (exit 3).  What happened: still
    running after 9 s (it would take over a minute): ``DeadlineConnection._heard``
    restarts its count on every readable byte, even one that completes no message, so
    a statement's wait has no bound while anything trickles in."""
    host, port = pg_host_port(inbox_dsn)
    with trickling_proxy(host, port, b"to_regclass", gap=1.0) as proxy:
        env = cli_env(proxied_dsn(inbox_dsn, proxy))
        with started({"it": ["parked", "list"]}, env) as procs:
            hung = still_running_after(procs, 9)
        assert proxy.trickling, "the proxy never saw the statement"
    assert hung == [], "parked list still runs 9 s into a trickling answer"
    it = procs["it"]
    assert it.returncode == 3, it.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timed_get(url: str, timeout: float) -> tuple[float, int | str]:
    began = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            answer: int | str = int(response.status)
    except urllib.error.HTTPError as exc:
        answer = int(exc.code)
    except OSError as exc:
        answer = f"no answer: {exc!r}"
    return time.monotonic() - began, answer


def test_web__connect_timeout_bounds_the_inbox_sessions_too(inbox_dsn: str) -> None:
    """Shape: ``outbox web --connect-timeout 2 --inbox-dsn …`` whose inbox database
    (a path to it that accepts TCP connections, then forwards nothing once the client
    sends its startup packet) never completes a connection.  --connect-timeout is
    "Seconds to wait when connecting to either server": the Parked page must be
    answered (an error page) within a generous 6 s.  What happened: about 10 s, each
    time (no answer within the test's 7 s): ``console.parked_store`` builds
    ``ParkedStore`` without ``connect_timeout`` (``InboxTarget`` carries none), so
    the inbox's sessions wait ``ParkedStore``'s default of 10 s whatever the option
    says; the charts sampler's inbox sessions too."""
    host, port = pg_host_port(inbox_dsn)
    web_port = _free_port()
    with stalling_proxy(host, port, b"user\x00") as proxy:
        env = cli_env(inbox_dsn)
        args = [
            "web",
            "--port",
            str(web_port),
            "--inbox-dsn",
            proxied_dsn(inbox_dsn, proxy),
            "--inbox-table",
            INBOX,
            "--connect-timeout",
            "2",
        ]
        base = f"http://127.0.0.1:{web_port}"
        with started({"web": args}, env):
            wait_for(
                lambda: isinstance(_timed_get(base + "/static/console.css", 1)[1], int),
                what="the console to start",
            )
            took, answer = _timed_get(base + "/parked", 7)
        assert proxy.stalled, "the inbox session never connected through the proxy"
    assert isinstance(answer, int) and took < 6, f"the Parked page: {answer} after {took:.1f} s"
    assert answer >= 500, answer


def test_parked_retry__headers_larger_than_a_frame_do_not_block_the_others(
    inbox_dsn: str, topology: Topology
) -> None:
    """Shape: the oldest parked message has a 300 kB header table (larger than the
    128 kB frame the retry's connection negotiates) and no raw properties (a row
    parked before they were kept, as ``QueuePublisher.publish`` still takes; or a
    consumer whose broker connection allowed larger frames); two more are plain.
    ``parked retry --all`` must send the two back and keep the big one parked, saying
    why (exit 1), as for a message the broker returns or nacks.  What happened: exit 3,
    "RabbitMQ did not take parked message huge1 …: FrameError(501, 'FRAME_ERROR …
    frame_too_large …')" with the hint "check that the queue exists", nothing sent, on
    every run: the broker closes the connection on the oversized content header,
    which ends the run.  ``QueuePublisher._fitting`` checks the frame only for rows
    with raw properties, and even there falls back to the raw list as it arrived
    when nothing fits; the ``amqp.Message`` path (no raw properties) checks nothing."""
    insert_parked(inbox_dsn, topology.queue, 1, message_id="'huge' || i")
    with psycopg.connect(inbox_dsn) as conn:
        conn.execute(
            f"UPDATE {INBOX}_parked SET headers = jsonb_build_object('h', repeat('h', 300000))"
        )
    insert_parked(inbox_dsn, topology.queue, 2, message_id="'good' || i")
    done = run_cli(
        "parked", "retry", "--all", env=cli_env(inbox_dsn, topology.amqp_url), timeout=60
    )
    assert "Traceback" not in done.stderr, done.stderr
    arrived = sorted(props.message_id for _method, props, _body in topology.messages())
    assert arrived == ["good1", "good2"], (arrived, done.stderr)
    assert count(inbox_dsn, f"SELECT count(*) FROM {INBOX}_parked") == 1
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "queue exists" not in done.stderr, done.stderr


def test_web__static_files_and_shutdown_while_every_call_slot_is_stalled(
    inbox_dsn: str, settings: Settings
) -> None:
    """Shape: the console (statement timeout 1 s: a 3 s client deadline) whose
    PostgreSQL stops answering once a query is sent; 24 requests for the Parked and
    Dead letters pages at once take all 16 of ``Calls``' slots and queue behind them.
    Meanwhile a request that needs no database (a static file) must be answered
    within 1 s, and the server asked to stop must have stopped within 12 s."""
    host, port = pg_host_port(inbox_dsn)
    with stalling_proxy(host, port, b"FROM") as proxy:
        proxied = proxied_dsn(inbox_dsn, proxy)
        outbox_settings = dataclasses.replace(
            settings, dsn=proxied, statement_timeout=1.0, lock_timeout=1.0, connect_timeout=2.0
        )
        inbox = InboxTarget(proxied, INBOX, statement_timeout=1.0, lock_timeout=1.0)
        config = ConsoleConfig((outbox_settings,), (inbox,), sample_seconds=3600)
        console = start_console(WebConfig(config, settings.amqp_url, Credentials()))
        pool = concurrent.futures.ThreadPoolExecutor(24)
        try:
            pages = [console.url + p for p in ["/parked", "/dead-letters"] * 12]
            pending = [pool.submit(_timed_get, url, 15) for url in pages]
            wait_for(lambda: proxy.stalled >= 8, 10, "the calls to stall")
            took, answer = _timed_get(console.url + "/static/console.css", 5)
            assert answer == 200 and took < 1, (answer, took)
            began = time.monotonic()
            console.stop()
            stopped_after = time.monotonic() - began
            assert not console.thread.is_alive(), "the console still runs"
            assert stopped_after < 12, stopped_after
        finally:
            proxy.cut_all()
            console.stop()
            for future in pending:
                future.result()
            pool.shutdown()
