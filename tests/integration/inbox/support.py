"""Helpers for the consumer's tests that run ``outbox consume`` as a user does: a
subprocess loading a handler module, raw messages published with pika (any bytes
a client can put in a frame), and the consumer's tables read back with psycopg.

The handler ``act`` does what the first word of the body says (``ok:…``,
``raise:…``, ``commit:…``), so one queue can mix good messages with hostile
handler behaviours.  Every effect is one row in ``effects``, a table WITHOUT a
unique constraint: a doubled effect shows as two rows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest

from tests.fixtures.faults import wait_for
from tests.fixtures.servers import Topology

INBOX = "inbox"

HANDLERS = r'''
import os, time
import psycopg
from psycopg import sql
from psycopg.rows import dict_row

EFFECTS = sql.Identifier(os.environ.get("EFFECTS_TABLE", "effects"))


class Fatal(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt."""


def record(conn, message):
    conn.execute(
        sql.SQL("INSERT INTO {} (message_id, body) VALUES (%s, %s)").format(EFFECTS),
        [message.message_id, message.body],
    )


def act(conn, message):
    """Do what the body's first word says."""
    what = message.body.split(b":", 1)[0].decode()
    if what == "ok":
        record(conn, message)
    elif what == "raise":
        raise RuntimeError("the handler refuses " + repr(message.body[:20]))
    elif what == "raise_nul":
        raise ValueError("text with a NUL \x00 and a lone surrogate \udcff")
    elif what == "exit":
        raise SystemExit(3)
    elif what == "interrupt":
        raise KeyboardInterrupt
    elif what == "fatal":
        raise Fatal("a BaseException")
    elif what == "commit":
        record(conn, message)
        conn.execute("COMMIT")
    elif what == "commit_more":
        record(conn, message)
        conn.commit()
        conn.execute("SELECT 1")
    elif what == "rollback":
        record(conn, message)
        conn.rollback()
    elif what == "close":
        record(conn, message)
        conn.close()
    elif what == "swallow":
        record(conn, message)
        try:
            conn.execute("SELECT 1/0")
        except psycopg.Error:
            pass
    elif what == "row_factory":
        conn.row_factory = dict_row
        record(conn, message)
    elif what == "autocommit":
        conn.autocommit = not conn.autocommit
        record(conn, message)
    elif what == "read_only":
        conn.read_only = True
        record(conn, message)
    elif what == "sleep":
        # Outlives the server's idle_in_transaction_session_timeout (IDLE_TIMEOUT_MS).
        record(conn, message)
        time.sleep(float(os.environ.get("HANDLER_SLEEP", "1.5")))
    elif what == "statement_timeout":
        conn.execute("SET LOCAL statement_timeout = 100")
        conn.execute("SELECT pg_sleep(1)")
    elif what == "terminate":
        # The handler's own session is ended by the server (pg_terminate_backend).
        record(conn, message)
        conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    elif what == "set_search_path":
        # A plain SET (not SET LOCAL) that commits with the effect: the session keeps it.
        record(conn, message)
        conn.execute("SELECT set_config('search_path', 'nowhere', false)")
    elif what in ("die", "sigkill") and os.environ.get("HANDLER_FIXED"):
        record(conn, message)
    elif what == "die" and os.environ.get("HANDLER_RAISES"):
        raise RuntimeError("the killer raises this time")
    elif what == "thread":  # leaves a thread that is not a daemon running
        import threading

        record(conn, message)
        threading.Thread(target=time.sleep, args=(3600,), name="left-by-handler").start()
    elif what == "slow":  # a healthy handler that takes OK_SLOW seconds
        record(conn, message)
        time.sleep(float(os.environ.get("OK_SLOW", "0.01")))
    elif what == "die":
        # Kills the process, as a segfault or the OOM killer would: no except runs.
        os._exit(1)
    elif what == "sigkill":
        os.kill(os.getpid(), 9)
    elif what == "own_connect":
        psycopg.connect("postgresql://nobody@127.0.0.1:1/nothing", connect_timeout=1)
    elif what == "generator":  # what a function with yield returns: nothing ran yet
        return (record(conn, message) for _ in [1])
    elif what == "async_generator":
        return _agen(conn, message)
    elif what == "coroutine":  # an async function called without await
        return act_async(conn, message)
    elif what == "raise_huge":  # a whole response body in the message
        raise RuntimeError("x" * int(os.environ.get("HUGE_BYTES", "100000000")))
    else:
        raise AssertionError(f"unknown behaviour {what!r}")


async def _agen(conn, message):
    record(conn, message)
    yield


async def act_async(conn, message):
    """``act`` as an async def handler on the consumer's AsyncConnection (the
    behaviours the property test mixes, and ``cancel``)."""
    import asyncio

    what = message.body.split(b":", 1)[0].decode()
    insert = sql.SQL("INSERT INTO {} (message_id, body) VALUES (%s, %s)").format(EFFECTS)
    if what in ("ok", "set_search_path", "commit", "commit_more", "rollback", "close",
                "swallow", "row_factory", "autocommit", "read_only", "sleep", "cancel",
                "cancel_return", "cancel_raise", "terminate") or (
                    what in ("die", "sigkill") and os.environ.get("HANDLER_FIXED")):
        await conn.execute(insert, [message.message_id, message.body])
    if what in ("die", "sigkill") and os.environ.get("HANDLER_FIXED"):
        return
    if what == "ok":
        return
    if what == "slow":
        await conn.execute(insert, [message.message_id, message.body])
        await asyncio.sleep(float(os.environ.get("OK_SLOW", "0.01")))
        return
    if what == "raise":
        raise RuntimeError("the handler refuses " + repr(message.body[:20]))
    if what == "raise_nul":
        raise ValueError("text with a NUL \x00 and a lone surrogate \udcff")
    if what == "exit":
        raise SystemExit(3)
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "fatal":
        raise Fatal("a BaseException")
    if what == "coroutine":  # forgot an await
        return conn.execute(insert, [message.message_id, message.body])
    if what == "cancel":  # the handler's task is cancelled (a timeout, a shutdown)
        asyncio.current_task().cancel()
        await asyncio.sleep(0)
    elif what == "cancel_return":  # cancels its own task and returns at once
        asyncio.current_task().cancel()
    elif what == "cancel_raise":  # raises CancelledError itself
        raise asyncio.CancelledError("the handler gives up")
    elif what == "commit":
        await conn.execute("COMMIT")
    elif what == "commit_more":
        await conn.commit()
        await conn.execute("SELECT 1")
    elif what == "rollback":
        await conn.rollback()
    elif what == "close":
        await conn.close()
    elif what == "swallow":
        try:
            await conn.execute("SELECT 1/0")
        except psycopg.Error:
            pass
    elif what == "row_factory":
        conn.row_factory = dict_row
    elif what == "autocommit":
        await conn.set_autocommit(not conn.autocommit)
    elif what == "read_only":
        await conn.set_read_only(True)
    elif what == "sleep":
        await asyncio.sleep(float(os.environ.get("HANDLER_SLEEP", "1.5")))
    elif what == "statement_timeout":
        await conn.execute("SET LOCAL statement_timeout = 100")
        await conn.execute("SELECT pg_sleep(1)")
    elif what == "terminate":
        await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
    elif what == "set_search_path":
        await conn.execute("SELECT set_config('search_path', 'nowhere', false)")
    elif what == "die":
        os._exit(1)
    elif what == "sigkill":
        os.kill(os.getpid(), 9)
    elif what == "own_connect":
        await psycopg.AsyncConnection.connect(
            "postgresql://nobody@127.0.0.1:1/nothing", connect_timeout=1
        )
    else:
        raise AssertionError(f"unknown behaviour {what!r}")
'''


def create_effects_table(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "CREATE TABLE effects (n bigserial, message_id text, body bytea, "
            "at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
    return dsn


def rows(dsn: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(query, params).fetchall()


def scalar(dsn: str, query: str, params: Any = None) -> Any:
    return rows(dsn, query, params)[0][0]


def effect_bodies(dsn: str) -> list[bytes]:
    return [bytes(r[0]) for r in rows(dsn, "SELECT body FROM effects ORDER BY n")]


def parked_bodies(dsn: str) -> list[bytes]:
    return [bytes(r[0]) for r in rows(dsn, f"SELECT body FROM {INBOX}_parked ORDER BY id")]


def inbox_key(message_id: bytes) -> str:
    """The inbox's text key of a message id (the documented escape): the id itself
    when it is UTF-8 without NUL and does not start with ``\\x``; otherwise ``\\x``
    and the hex of its bytes."""
    try:
        text = message_id.decode("utf-8")
    except UnicodeDecodeError:
        return "\\x" + message_id.hex()
    if "\x00" in text or text.startswith("\\x"):
        return "\\x" + message_id.hex()
    return text


def publish(
    topology: Topology,
    messages: Iterable[tuple[bytes | str | None, bytes]],
    *,
    headers: dict[str, Any] | None = None,
    **properties: Any,
) -> None:
    """Publish (message_id, body) pairs, persistent, confirmed, to the test's queue.
    A bytes message_id goes on the wire as it is (pika writes bytes verbatim)."""
    ch = topology.channel()
    ch.confirm_delivery()
    for message_id, body in messages:
        props = pika.BasicProperties(
            delivery_mode=2, message_id=message_id, headers=headers, **properties
        )
        ch.basic_publish("", topology.queue, body, props)
    ch.connection.close()


def queue_depth(topology: Topology) -> int:
    """Ready plus unacked messages of the queue (RabbitMQ's passive declare counts
    only ready ones: wait for the consumer to settle what it holds)."""
    ch = topology.channel()
    count = int(ch.queue_declare(topology.queue, passive=True).method.message_count)
    ch.connection.close()
    return count


class Consumer:
    """``outbox consume handlers:act`` in a subprocess, from a folder holding the
    handler module, the way a user runs it."""

    def __init__(
        self,
        folder: Path,
        dsn: str,
        topology: Topology,
        *,
        function: str = "act",
        max_attempts: int = 2,
        prefetch: int = 10,
        env: dict[str, str] | None = None,
    ) -> None:
        (folder / "handlers.py").write_text(HANDLERS)
        environ = dict(os.environ)
        environ.pop("OUTBOX_CRASH_AT", None)
        environ.update(
            OUTBOX_DSN=dsn,
            OUTBOX_AMQP_URL=topology.amqp_url,
            OUTBOX_QUEUE=topology.queue,
            OUTBOX_INBOX_TABLE=INBOX,
            OUTBOX_MAX_ATTEMPTS=str(max_attempts),
            OUTBOX_PREFETCH=str(prefetch),
            OUTBOX_RETRY_DELAY="0.01",
            OUTBOX_RETRY_DELAY_MAX="0.05",
            OUTBOX_BACKOFF_INITIAL="0.05",
            OUTBOX_BACKOFF_MAX="0.5",
            OUTBOX_CONNECT_TIMEOUT="3",
            OUTBOX_LOG_LEVEL="debug",
        )
        environ.update(env or {})
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._final = ""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "outbox", "consume", f"handlers:{function}"],
            cwd=folder,
            env=environ,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        if self._log.closed:
            return self._final
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def started(self, timeout: float = 30.0) -> Consumer:
        wait_for(
            lambda: "consumer.started" in self.output() or not self.alive(),
            timeout,
            "the consumer to start",
        )
        assert self.alive(), self.output()[-3000:]
        return self

    def terminate(self, timeout: float = 30.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"consumer did not exit within {timeout}s:\n{self.output()[-3000:]}")

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self.process.wait(timeout=30)

    def close(self) -> None:
        if self.alive():
            self.kill()
        self._final = self.output()
        self._log.close()


@contextlib.contextmanager
def consumer(folder: Path, dsn: str, topology: Topology, **options: Any) -> Any:
    """A started consumer; at the end it must still be running and stop with 0 on
    SIGTERM (a message must never make it exit)."""
    process = Consumer(folder, dsn, topology, **options)
    _running.append(process)
    try:
        yield process.started()
        assert process.alive(), f"the consumer exited:\n{process.output()[-4000:]}"
        code = process.terminate()
        assert code == 0, f"exit {code}:\n{process.output()[-4000:]}"
    finally:
        _running.remove(process)
        process.close()


# The consumers started by ``consumer()``: ``wait_settled`` fails at once when one
# of them exits (a message made it exit) instead of waiting for its timeout.
_running: list[Consumer] = []


def wait_settled(dsn: str, topology: Topology, expected: Sequence[bytes], timeout: float) -> None:
    """Until every body in ``expected`` has an effect or is parked, and the queue
    has nothing ready."""

    def settled() -> bool:
        for process in _running:
            assert process.alive(), f"the consumer exited:\n{process.output()[-4000:]}"
        done = set(effect_bodies(dsn)) | set(parked_bodies(dsn))
        return set(expected) <= done and queue_depth(topology) == 0

    wait_for(settled, timeout, f"{len(expected)} messages to settle")
