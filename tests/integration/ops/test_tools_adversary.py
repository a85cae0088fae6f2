"""Adversarial tests of the operator tools (``outbox status``, ``dead-letters``,
``parked``, ``web``) against the promise: "Operator commands that cannot stall the
consumer: a confirm timeout, lock_timeout/statement_timeout on their sessions, no
transaction held across a network wait, bodies streamed in bounded memory (a budget
in bytes, not a count).  Errors that say what is wrong and how to fix it (never a
traceback for a known condition).  Bad rows and bad messages neither block good ones
nor vanish."

Each test states the shape it tries, and what went wrong before the fix where
something did ("What happened"): 11 of these shapes failed on the code of 0.6.0's
first adversary round and pass since (a silent PostgreSQL or broker hanging a
command or the console, lists and retry pages whose memory grew with what rows held,
terminal escapes, a message blocking the rest of a retry, a traceback on Ctrl-C or a
non-UTF-8 key, a daemon's hint for an operator's lost session).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pika
import psycopg
import pytest

from outbox.config import Settings
from outbox.web.app import WebConfig
from outbox.web.console import ConsoleConfig, InboxTarget
from outbox.web.security import Credentials
from tests.fixtures.faults import TcpProxy, proxied_amqp_url, proxied_dsn, wait_for
from tests.fixtures.servers import Topology, outbox_command, run_cli
from tests.fixtures.web import create_inbox, start_console

INBOX = "inbox"
MB = 1024 * 1024

# AMQP channel.open (class 20, method 10) as it follows a method frame's header.
CHANNEL_OPEN = b"\x00\x14\x00\x0a"


class StallingProxy(TcpProxy):
    """Forwards each connection until its client sends ``pattern``; from then on that
    connection forwards nothing either way and stays open: a server (or a network path)
    that stops answering without closing anything.  The proxy's kernel still
    acknowledges every segment and every keepalive, as a stateful firewall, a load
    balancer or a stopped server process would."""

    def __init__(self, host: str, port: int, pattern: bytes) -> None:
        self.stall_pattern = pattern
        self.stalled = 0
        super().__init__(host, port)

    def _upstream(self, pair: Any) -> None:
        with contextlib.suppress(OSError):
            while data := pair.client.recv(65536):
                if not pair.orphaned and self.stall_pattern in data:
                    pair.orphaned = True  # _downstream drops what the server sends
                    self.stalled += 1
                if pair.orphaned:
                    continue
                pair.server.sendall(data)
        pair.cut()


@contextlib.contextmanager
def stalling_proxy(host: str, port: int, pattern: bytes) -> Iterator[StallingProxy]:
    proxy = StallingProxy(host, port, pattern)
    try:
        yield proxy
    finally:
        proxy.close()


def pg_host_port(dsn: str) -> tuple[str, int]:
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    return str(info.get("host", "127.0.0.1")), int(str(info.get("port", 5432)))


def cli_env(dsn: str, amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/%2F") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    env.update(
        OUTBOX_DSN=dsn,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_INBOX_TABLE=INBOX,
        OUTBOX_CONNECT_TIMEOUT="2",
        OUTBOX_STATEMENT_TIMEOUT="1",
        OUTBOX_LOCK_TIMEOUT="1",
        OUTBOX_PUBLISH_TIMEOUT="2",
    )
    return env


class Command:
    """One ``outbox`` subprocess; ``stdout``/``stderr`` once it has ended."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [*outbox_command(), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout = self.stderr = ""

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def finish(self) -> None:
        """Kill it if it still runs, and collect its output."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
        self.stdout, self.stderr = self.proc.communicate(timeout=30)


@contextlib.contextmanager
def started(commands: dict[str, list[str]], env: dict[str, str]) -> Iterator[dict[str, Command]]:
    """``outbox`` subprocesses by name, killed if still running when the block ends."""
    procs = {name: Command(args, env) for name, args in commands.items()}
    try:
        yield procs
    finally:
        for command in procs.values():
            command.finish()


def still_running_after(procs: dict[str, Command], seconds: float) -> list[str]:
    """The names of ``procs`` that have not ended ``seconds`` from now."""
    deadline = time.monotonic() + seconds
    for command in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            command.proc.wait(max(0.0, deadline - time.monotonic()))
    return sorted(name for name, command in procs.items() if command.returncode is None)


def insert_parked(dsn: str, queue: str, count: int, **columns: str) -> None:
    """``count`` parked rows (message ids m1 … mN) for ``queue``; ``columns`` give SQL
    expressions (of ``i``) for error, message_id, body."""
    error = columns.get("error", "'ValueError: refused'")
    message_id = columns.get("message_id", "'m' || i")
    body = columns.get("body", "convert_to('body ' || i, 'UTF8')")
    with psycopg.connect(dsn) as conn:
        conn.execute(
            f"INSERT INTO {INBOX}_parked (consumer, message_id, queue, exchange, routing_key,"
            " body, headers, properties, error, attempts)"
            f" SELECT 'c', {message_id}, %(queue)s, '', %(queue)s, {body}, '{{}}', '{{}}',"
            f" {error}, 3 FROM generate_series(1, %(count)s) AS i",
            {"queue": queue, "count": count},
        )


def count(dsn: str, query: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


@pytest.fixture
def inbox_dsn(dsn: str) -> str:
    """This test's database with the outbox schema and the inbox tables."""
    create_inbox(dsn, INBOX)
    return dsn


# -- a PostgreSQL that stops answering ------------------------------------------------
def test_operator_commands__a_postgresql_that_stops_answering_mid_statement_ends_them(
    inbox_dsn: str,
) -> None:
    """Shape: a TCP path to PostgreSQL that stops forwarding (both ways, connections
    kept open) once a command sends its first real query.  With --statement-timeout 1,
    --lock-timeout 1 and --connect-timeout 2 every command must end within a generous
    8 s with a one-line error (exit 3 or 6).  What happened: parked list, parked purge,
    dead-letters list, dead-letters retry, status and resolve all still ran after 8 s (they
    wait for ever: the proxy's kernel acknowledges everything)."""
    insert_parked(inbox_dsn, "q", 2)
    host, port = pg_host_port(inbox_dsn)
    commands = {
        "parked list": ["parked", "list"],
        "parked purge": ["parked", "purge", "--all"],
        "dead-letters list": ["dead-letters", "list"],
        "dead-letters retry": ["dead-letters", "retry", "--all"],
        "status": ["status"],
        "resolve": ["resolve"],
    }
    with stalling_proxy(host, port, b"FROM") as proxy:
        env = cli_env(proxied_dsn(inbox_dsn, proxy))
        with started(commands, env) as procs:
            hung = still_running_after(procs, 8)
    assert hung == [], f"still running after 8 s: {hung}"
    for name, proc in procs.items():
        assert proc.returncode in (3, 6), (name, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr, (name, proc.stderr)


def backend_waiting_for_a_lock(dsn: str, application_name: str) -> int | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
            " AND wait_event_type = 'Lock'",
            [application_name],
        ).fetchone()
    return int(row[0]) if row else None


def test_parked_list__a_stopped_backend_does_not_hang_it(inbox_dsn: str) -> None:
    """Shape: ``parked list`` waits for a lock another session holds (ACCESS EXCLUSIVE on
    the parked table) and its backend is then stopped (SIGSTOP, as a backend stuck in
    I/O or a frozen VM).  With --lock-timeout 2 and --statement-timeout 3 it must end
    within a generous 8 s (exit 3 or 6).  What happened: it waited for ever (the
    server's timers cannot fire in a stopped process, the kernel still acknowledges)."""
    insert_parked(inbox_dsn, "q", 1)
    env = {**cli_env(inbox_dsn), "OUTBOX_LOCK_TIMEOUT": "2", "OUTBOX_STATEMENT_TIMEOUT": "3"}
    stopped: list[int] = []
    with psycopg.connect(inbox_dsn) as holder:
        holder.execute(f"LOCK TABLE {INBOX}_parked IN ACCESS EXCLUSIVE MODE")
        try:
            with started({"parked list": ["parked", "list"]}, env) as procs:
                pid = wait_for(
                    lambda: backend_waiting_for_a_lock(inbox_dsn, "outbox-parked"),
                    10,
                    "parked list to wait for the lock",
                )
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
                hung = still_running_after(procs, 8)
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)
            holder.rollback()
    assert hung == [], "parked list still ran 8 s after its backend stopped"
    assert procs["parked list"].returncode in (3, 6), procs["parked list"].stderr


# -- a RabbitMQ that stops answering --------------------------------------------------
def test_parked_retry__a_broker_that_stops_answering_after_the_handshake_ends_it(
    inbox_dsn: str, topology: Topology
) -> None:
    """Shape: a TCP path to RabbitMQ that stops forwarding once ``parked retry`` opens
    its channel (the connection handshake went through: a broker that froze, a proxy
    that lost its upstream).  With --connect-timeout 2 and --publish-timeout 2 it must
    end within a generous 8 s with exit 3 or 6, every message still parked.  What
    happened: it waited for ever on channel.open."""
    insert_parked(inbox_dsn, topology.queue, 3)
    broker = pika.URLParameters(topology.amqp_url)
    with stalling_proxy(broker.host, broker.port, CHANNEL_OPEN) as proxy:
        env = cli_env(inbox_dsn, proxied_amqp_url(topology.amqp_url, proxy))
        with started({"parked retry": ["parked", "retry", "--all"]}, env) as procs:
            hung = still_running_after(procs, 8)
    assert hung == [], "parked retry still ran 8 s after the broker stopped answering"
    retry = procs["parked retry"]
    assert retry.returncode in (3, 6), retry.stderr
    assert "Traceback" not in retry.stderr
    assert count(inbox_dsn, f"SELECT count(*) FROM {INBOX}_parked") == 3


# -- the console ------------------------------------------------------------------------
def console_sessions(dsn: str) -> int:
    """The console's PostgreSQL sessions in this test's database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE 'outbox%'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def get(url: str, timeout: float) -> int | str:
    """The status of a GET, or why there was none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError as exc:
        return f"no answer: {exc!r}"


def test_web__fifty_requests_to_a_postgresql_that_stops_answering_are_each_answered(
    inbox_dsn: str, settings: Settings
) -> None:
    """Shape: ``outbox web`` whose PostgreSQL stops answering mid-statement (a TCP path
    that stops forwarding once a query is sent, connections kept open); 50 requests for
    the dead-letter and parked lists, 10 at a time.  Each must be answered (an error
    page) within a generous 8 s, and afterwards the console must hold no more threads
    or sessions than before.  What happened: no request was answered, each kept a
    thread of the console's threadpool and a PostgreSQL session."""
    host, port = pg_host_port(inbox_dsn)
    with stalling_proxy(host, port, b"FROM") as proxy:
        proxied = proxied_dsn(inbox_dsn, proxy)
        outbox_settings = dataclasses.replace(
            settings, dsn=proxied, statement_timeout=1.0, lock_timeout=1.0, connect_timeout=2.0
        )
        inbox = InboxTarget(proxied, INBOX, statement_timeout=1.0, lock_timeout=1.0)
        config = ConsoleConfig((outbox_settings,), (inbox,), sample_seconds=3600)
        console = start_console(WebConfig(config, settings.amqp_url, Credentials()))
        try:
            threads_before = threading.active_count()
            sessions_before = console_sessions(inbox_dsn)
            paths = ["/dead-letters", "/parked"] * 25
            answers: list[int | str] = []
            with concurrent.futures.ThreadPoolExecutor(10) as pool:
                for start in range(0, len(paths), 10):
                    urls = [console.url + path for path in paths[start : start + 10]]
                    batch = list(pool.map(lambda url: get(url, 8), urls))
                    answers.extend(batch)
                    if any(isinstance(a, str) for a in batch):
                        break  # the console hangs: no need to wait for the other batches
            unanswered = [a for a in answers if isinstance(a, str)]
            assert unanswered == [], f"{len(unanswered)} of {len(answers)}: {unanswered[0]}"
            assert all(500 <= int(a) < 600 for a in answers), answers
            wait_for(lambda: threading.active_count() <= threads_before + 2, 10, "threads")
            wait_for(lambda: console_sessions(inbox_dsn) <= sessions_before, 10, "sessions")
        finally:
            proxy.cut_all()
            console.stop()


# -- hostile content and absurd values ---------------------------------------------------
ESC = "\x1b"


def test_parked_list__escape_sequences_and_newlines_in_a_message_reach_no_terminal(
    inbox_dsn: str,
) -> None:
    """Shape: a parked message whose message_id (any publisher sets it) and error (a
    handler's exception text quotes the message) hold terminal escape sequences (OSC:
    set the window title; CSI: clear the screen) and a newline.  ``parked list`` must
    print them escaped, one listed line each.  What happened: ESC bytes were written to
    stdout (click strips CSI when piped, not OSC, and nothing on a terminal) and the
    newline started a line of the attacker's choosing."""
    insert_parked(
        inbox_dsn,
        "q",
        1,
        message_id=r"E'id-\x1b]0;owned\x07-\x1b[2J'",
        error=r"E'ValueError: bad \x1b]0;owned\x07\x1b[2J\nerror: fake line'",
    )
    done = run_cli("parked", "list", env=cli_env(inbox_dsn), timeout=60)
    assert done.returncode == 0, done.stderr
    assert ESC not in done.stdout and "\x07" not in done.stdout, repr(done.stdout)
    assert not any(line.startswith("error:") for line in done.stdout.splitlines()), done.stdout


def test_parked_list__a_limit_beyond_what_postgresql_counts_is_a_usage_error(
    inbox_dsn: str,
) -> None:
    """Shape: ``parked list --limit 9223372036854775808`` (2**63).  A bad option value
    must be a usage error: one line, exit 2, before anything connects (as
    ``dead-letters list --limit`` does, which stops at 2**31-1).  What happened: exit 1
    (documented as "a bug") with "PostgreSQL refused listing parked messages: bigint
    out of range" and a hint to check the inbox tables and the role's rights."""
    done = run_cli("parked", "list", "--limit", str(2**63), env=cli_env(inbox_dsn), timeout=60)
    assert "Traceback" not in done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)


@pytest.mark.parametrize(
    "args",
    [
        ["parked", "list", "--limit", "0"],
        ["parked", "list", "--limit", "-1"],
        ["parked", "list", "--limit", "ten"],
        ["dead-letters", "list", "--limit", str(2**63)],
        ["parked", "purge", "--older-than", "-5d"],
        ["parked", "purge", "--older-than", "101y"],
        ["parked", "purge", "--older-than", "1e400s"],
        ["dead-letters", "purge", "--older-than", "nan"],
        ["dead-letters", "retry", str(2**63)],
        ["dead-letters", "retry", "-1"],
        ["dead-letters", "retry", "\u00b2"],
        ["parked", "retry"],
        ["parked", "retry", "--all", "m1"],
    ],
    ids=lambda args: " ".join(args).encode("unicode_escape").decode(),
)
def test_operator_commands__absurd_values_are_one_line_usage_errors(
    args: list[str], inbox_dsn: str
) -> None:
    """Shape: absurd option values and ids (zero, negative, beyond bigint, not a number,
    not finite, a superscript digit that ``str.isdigit`` takes for a digit).  Held: one line,
    exit 2, no traceback."""
    done = run_cli(*args, env=cli_env(inbox_dsn), timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("error: "), done.stderr


# -- memory ---------------------------------------------------------------------------
# A command in a process of its own whose peak RSS its parent reports (bytes).
PEAK_RSS = r"""
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
sys.stderr.buffer.write(done.stderr)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(done.returncode)
"""


def peak_rss(args: list[str], env: dict[str, str]) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, *outbox_command(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


LISTED = 8  # rows listed, each with a 10 MB text column
LISTED_BYTES = 10 * MB


@pytest.mark.parametrize("command", ["parked list", "dead-letters list"])
def test_list__memory_is_bounded_by_bytes_not_by_how_much_the_rows_hold(
    command: str, inbox_dsn: str
) -> None:
    """Shape: 8 rows listed whose text columns hold 10 MB each: a parked message whose
    handler's exception quoted its 10 MB body on one line (the error is the first line
    of ``str(exc)``, of any length), a dead letter whose routing key is 10 MB (the
    reason it is a dead letter: AMQP allows 255 bytes; the outbox column has no limit).
    The peak RSS of the list must stay well below the 80 MB listed (at most half of it
    over the same command listing small rows).  What happened: parked list took about
    5 times the listed bytes over its baseline, dead-letters list about twice (4 times
    with --json)."""
    args = command.split()
    env = cli_env(inbox_dsn)
    if command == "parked list":
        insert_parked(inbox_dsn, "q", LISTED)
        baseline = peak_rss(args, env)
        with psycopg.connect(inbox_dsn) as conn:
            conn.execute(
                f"UPDATE {INBOX}_parked SET error = 'ValueError: bad body ' || repeat('x', %s)",
                [LISTED_BYTES],
            )
    else:
        insert = (
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload,"
            " created_at, reason) SELECT i, gen_random_uuid(), 'ex', {key}, 'p', now(),"
            " 'routing_key is too long' FROM generate_series(1, %s) AS i"
        )
        with psycopg.connect(inbox_dsn) as conn:
            conn.execute(insert.format(key="'rk'"), [LISTED])
        baseline = peak_rss(args, env)
        with psycopg.connect(inbox_dsn) as conn:
            conn.execute(
                "UPDATE outbox_dead_letters SET routing_key = repeat('k', %s)", [LISTED_BYTES]
            )
    peak = peak_rss(args, env)
    listed = LISTED * LISTED_BYTES
    assert peak - baseline < listed / 2, (
        f"{command}: peak {peak / MB:.0f} MB, {baseline / MB:.0f} MB listing small rows, "
        f"{listed / MB:.0f} MB listed"
    )


def test_parked_retry__headers_count_in_the_memory_budget(
    inbox_dsn: str, topology: Topology
) -> None:
    """Shape: 300 parked messages with 1-byte bodies and 100 kB header tables each
    (within a 128 kB AMQP frame; 30 MB in all), retried with --batch-max-bytes 1 MiB.
    Its peak RSS must stay within the budget's order over the same retry of messages
    without headers (less than half the 30 MB of headers).  What happened: the whole
    page of 300 rows was read at once, about twice the headers' size over baseline."""
    env = {**cli_env(inbox_dsn, topology.amqp_url), "OUTBOX_BATCH_MAX_BYTES": str(MB)}
    retry = ["parked", "retry", "--all"]
    insert_parked(inbox_dsn, topology.queue, 300, body="'x'")
    baseline = peak_rss(retry, env)
    insert_parked(inbox_dsn, topology.queue, 300, body="'x'")
    with psycopg.connect(inbox_dsn) as conn:
        conn.execute(
            f"UPDATE {INBOX}_parked SET headers = jsonb_build_object('h', repeat('h', %s))",
            [100_000],
        )
    peak = peak_rss(retry, env)
    assert count(inbox_dsn, f"SELECT count(*) FROM {INBOX}_parked") == 0
    headers = 300 * 100_000
    assert peak - baseline < headers / 2, (peak / MB, baseline / MB)


# -- bad messages and good ones -----------------------------------------------------------
def test_parked_retry__a_message_whose_queue_is_gone_does_not_block_the_others(
    inbox_dsn: str, topology: Topology
) -> None:
    """Shape: the oldest parked message came from a queue since deleted; two more from
    a queue that exists.  ``parked retry --all`` (twice) must send the two back and
    say which one it could not send (non-zero exit).  What happened: it stopped at the
    first with "RabbitMQ did not take parked message m1 … NO_ROUTE" (exit 3), the two
    good ones stayed parked, on every run."""
    insert_parked(inbox_dsn, f"gone.{uuid.uuid4().hex[:8]}", 1)
    insert_parked(inbox_dsn, topology.queue, 2, message_id="'good' || i")
    env = cli_env(inbox_dsn, topology.amqp_url)
    for _ in range(2):
        done = run_cli("parked", "retry", "--all", env=env, timeout=60)
        assert "Traceback" not in done.stderr
        assert done.returncode != 0
    arrived = sorted(props.message_id for _method, props, _body in topology.messages())
    assert arrived == ["good1", "good2"], (arrived, done.stderr)
    assert count(inbox_dsn, f"SELECT count(*) FROM {INBOX}_parked") == 1


# -- Ctrl-C and kill -9 -------------------------------------------------------------------
def interrupted_while_loading(
    env: dict[str, str], at: Callable[[str], bool]
) -> tuple[int, list[str]]:
    """``outbox parked list`` sent SIGINT as soon as a module ``at`` accepts has been
    imported (PYTHONPROFILEIMPORTTIME's lines on stderr): its exit code and the other
    lines of its stderr."""
    proc = subprocess.Popen(
        [*outbox_command(), "parked", "list"],
        env={**env, "PYTHONPROFILEIMPORTTIME": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if at(line.rsplit("|", 1)[-1].strip()):
                proc.send_signal(signal.SIGINT)
                break
        _out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return proc.returncode, [ln for ln in err.splitlines() if not ln.startswith("import time:")]


def test_cli__ctrl_c_at_start_up_prints_no_traceback(inbox_dsn: str) -> None:
    """Shape: ``outbox parked list`` sent SIGINT (an operator's Ctrl-C) while it is
    still starting: just after its first module of ``outbox`` is imported (told by
    PYTHONPROFILEIMPORTTIME's lines on stderr).  No moment may print a traceback.
    What happened: Python's KeyboardInterrupt traceback, ending in an import line."""
    code, err = interrupted_while_loading(
        cli_env(inbox_dsn), lambda module: module.startswith("outbox.")
    )
    shown = "\n".join(err)
    assert "Traceback" not in shown, shown[-800:]
    # Ended by the interrupt (or done before it came), saying so in one line.
    assert code in (0, 130), (code, shown[-800:])
    assert code == 0 or "error: interrupted" in shown, shown[-800:]


def test_cli__ctrl_c_while_it_works_is_one_line_and_exit_130(inbox_dsn: str) -> None:
    """Shape: ``parked list`` waiting for a lock (another session holds the parked
    table) when the operator presses Ctrl-C.  It must end at once with one line and
    exit 130 (128 + SIGINT), and its statement must not run on in the server.  What
    happened before: exit 1 with nothing said at all."""
    locker = psycopg.connect(inbox_dsn)
    locker.execute(f"LOCK TABLE {INBOX}_parked IN ACCESS EXCLUSIVE MODE")
    # Statistics views keep their first reading for the rest of a transaction: the
    # locker's own would never see the command arrive.
    watcher = psycopg.connect(inbox_dsn, autocommit=True)
    try:
        proc = subprocess.Popen(
            [*outbox_command(), "parked", "list", "--lock-timeout", "60"],
            env=cli_env(inbox_dsn),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(
            lambda: watcher.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            ).fetchone()[0],  # type: ignore[index]
            what="parked list waiting for the lock",
        )
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=30)
        waiting = watcher.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        ).fetchone()
    finally:
        locker.close()
        watcher.close()
    assert proc.returncode == 130, (proc.returncode, err)
    assert err.strip().startswith("error: interrupted") and "Traceback" not in err, err
    assert waiting == (0,), "the interrupted statement still waits in the server"


def inbox_ids(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {str(r[0]) for r in conn.execute(f"SELECT message_id FROM {INBOX}").fetchall()}


def parked_ids(dsn: str) -> set[str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(f"SELECT message_id FROM {INBOX}_parked").fetchall()
    return {str(r[0]) for r in rows}


def test_parked_retry__killed_or_interrupted_at_random_moments_loses_nothing(
    inbox_dsn: str, topology: Topology
) -> None:
    """Shape: ``parked retry --all`` (one message a page: --batch-max-bytes 1) sent
    SIGKILL or SIGINT at 4 moments spread over its run, then run to the end.  Held:
    after every interruption each message is still parked (with its inbox id, so the
    consumer skips no copy it needs: the id is gone only for a released page) or on
    the queue, and in the end every message is on the queue at least once, nothing is
    parked, and no inbox id of a retried message is left to make the consumer skip it."""
    ids = {f"k{i}" for i in range(1, 41)}
    insert_parked(inbox_dsn, topology.queue, 40, message_id="'k' || i")
    with psycopg.connect(inbox_dsn) as conn:  # as the consumer records a parked id
        conn.execute(
            f"INSERT INTO {INBOX} (consumer, message_id, received_at)"
            f" SELECT consumer, message_id, parked_at FROM {INBOX}_parked"
        )
    env = {**cli_env(inbox_dsn, topology.amqp_url), "OUTBOX_BATCH_MAX_BYTES": "1"}
    arrived: list[str] = []
    for attempt, delay in enumerate([0.6, 0.9, 1.1, 1.3]):
        with started({"retry": ["parked", "retry", "--all"]}, env) as procs:
            time.sleep(delay)
            with contextlib.suppress(ProcessLookupError):
                procs["retry"].proc.send_signal(signal.SIGINT if attempt % 2 else signal.SIGKILL)
            procs["retry"].proc.wait(30)
        arrived += [str(props.message_id) for _m, props, _b in topology.messages(idle=0.2)]
        parked_now = parked_ids(inbox_dsn)
        assert parked_now | set(arrived) == ids, sorted(ids - parked_now - set(arrived))
        # A message no longer parked must not leave its parking's inbox id behind.
        assert not (inbox_ids(inbox_dsn) - parked_now), sorted(inbox_ids(inbox_dsn) - parked_now)
    with started({"retry": ["parked", "retry", "--all"]}, env) as procs:
        assert procs["retry"].proc.wait(60) == 0
    arrived += [str(props.message_id) for _m, props, _b in topology.messages(idle=0.2)]
    assert set(arrived) == ids
    assert parked_ids(inbox_dsn) == set()
    assert inbox_ids(inbox_dsn) == set()


def test_parked_retry__a_routing_key_that_is_not_utf8_is_no_traceback(
    inbox_dsn: str, topology: Topology
) -> None:
    """Shape: a parked message whose original routing key was not UTF-8 (bytes 0xff 00
    fe: the consumer records it as its documented escape, ``\\xff00fe``; an older release
    recorded a key that merely looked so), parked before a good message.  ``parked
    retry --all`` must not print a traceback, and must send the good message back.
    What happened: "unexpected UnicodeDecodeError … this is a bug" with a traceback,
    exit 1, the good message still parked."""
    insert_parked(inbox_dsn, topology.queue, 1, message_id="'bin'")
    with psycopg.connect(inbox_dsn) as conn:
        conn.execute(f"UPDATE {INBOX}_parked SET routing_key = %s", ["\\xff00fe"])
    insert_parked(inbox_dsn, topology.queue, 1, message_id="'good'")
    done = run_cli(
        "parked", "retry", "--all", env=cli_env(inbox_dsn, topology.amqp_url), timeout=60
    )
    assert "Traceback" not in done.stderr, done.stderr[-600:]
    arrived = {str(props.message_id) for _method, props, _body in topology.messages()}
    assert "good" in arrived, (arrived, done.stderr)


@pytest.fixture
def pg_cutter(dsn: str) -> Iterator[TcpProxy]:
    host, port = pg_host_port(dsn)
    proxy = TcpProxy(host, port)
    yield proxy
    proxy.close()


def test_parked_retry__a_session_lost_after_the_publishes_says_to_run_it_again(
    inbox_dsn: str, topology: Topology, pg_cutter: TcpProxy
) -> None:
    """Shape: ``parked retry`` whose PostgreSQL connection is cut at step 3 (the delete
    of the rows whose copies were confirmed), then run again.  Held: exit 3, no
    traceback; the second run completes, every message on the queue, none parked.
    What went wrong: the error's hint read "the consumer reconnects by itself; check
    the server if this repeats": no consumer is involved, nothing reconnects, and the
    operator is not told to run the retry again."""
    insert_parked(inbox_dsn, topology.queue, 3)
    pg_cutter.arm(b"unnest(")
    first = run_cli(
        "parked",
        "retry",
        "--all",
        env=cli_env(proxied_dsn(inbox_dsn, pg_cutter), topology.amqp_url),
        timeout=60,
    )
    assert pg_cutter.triggered.is_set()
    second = run_cli(
        "parked", "retry", "--all", env=cli_env(inbox_dsn, topology.amqp_url), timeout=60
    )
    assert second.returncode == 0, second.stderr
    arrived = {str(props.message_id) for _method, props, _body in topology.messages()}
    assert arrived == {"m1", "m2", "m3"}
    assert count(inbox_dsn, f"SELECT count(*) FROM {INBOX}_parked") == 0
    assert first.returncode == 3, first.stderr
    assert "Traceback" not in first.stderr
    assert "consumer reconnects" not in first.stderr, first.stderr
    assert "again" in first.stderr, first.stderr


def test_parked_retry__a_routing_key_that_is_not_utf8_goes_back_as_its_bytes(
    inbox_dsn: str, topology: Topology
) -> None:
    """Shape: a parked message whose original routing key was the bytes 0xff 00 fe,
    recorded as the inbox's escape of those bytes (``\\xff00fe``) or, as the consumer
    records a key it read with those bytes as lone surrogates, as the escape of their
    UTF-8 with surrogates.  Held: both are sent back, exit 0, and the header from which
    the consumer restores the routing key holds the original bytes."""
    insert_parked(inbox_dsn, topology.queue, 2, message_id="'bin' || i")
    with psycopg.connect(inbox_dsn) as conn:
        conn.execute(
            f"UPDATE {INBOX}_parked SET routing_key = CASE message_id WHEN 'bin1' THEN %s"
            " ELSE %s END",
            ["\\xff00fe", "\\x" + "\udcff\x00\udcfe".encode("utf-8", "surrogatepass").hex()],
        )
    done = run_cli(
        "parked", "retry", "--all", env=cli_env(inbox_dsn, topology.amqp_url), timeout=60
    )
    assert done.returncode == 0, done.stderr
    keys = {
        str(props.message_id): props.headers["x-outbox-original-routing-key"]
        for _method, props, _body in topology.messages()
    }
    assert keys == {"bin1": b"\xff\x00\xfe", "bin2": b"\xff\x00\xfe"}, keys
    assert count(inbox_dsn, f"SELECT count(*) FROM {INBOX}_parked") == 0


def test_dead_letters_retry__a_session_lost_says_to_run_it_again(
    inbox_dsn: str, pg_cutter: TcpProxy
) -> None:
    """Shape: ``dead-letters retry --all`` whose PostgreSQL connection is cut at its
    one statement (the move back into the outbox), then run again.  Held: exit 3, no
    traceback, a hint that names no daemon ("the relay reconnects by itself": nothing
    reconnects an operator's command) and says to run it again; the second run moves
    every dead letter back."""
    with psycopg.connect(inbox_dsn) as conn:
        conn.execute(
            "INSERT INTO outbox_dead_letters (id, message_id, exchange, routing_key, payload,"
            " created_at, reason) SELECT i, gen_random_uuid(), 'ex', 'rk', 'p', now(),"
            " 'refused' FROM generate_series(1, 3) AS i"
        )
    pg_cutter.arm(b"WITH moved AS")
    first = run_cli(
        "dead-letters", "retry", "--all", env=cli_env(proxied_dsn(inbox_dsn, pg_cutter)), timeout=60
    )
    assert pg_cutter.triggered.is_set()
    assert first.returncode == 3, first.stderr
    assert "Traceback" not in first.stderr
    assert "reconnects by itself" not in first.stderr, first.stderr
    assert "again" in first.stderr, first.stderr
    second = run_cli("dead-letters", "retry", "--all", env=cli_env(inbox_dsn), timeout=60)
    assert second.returncode == 0, second.stderr
    assert count(inbox_dsn, "SELECT count(*) FROM outbox_dead_letters") == 0
    assert count(inbox_dsn, "SELECT count(*) FROM outbox") == 3
