"""Issue 31, item 4 (and issue 30, item 1, on the consumer's side): an operator's
command that stalls never stalls the consumer.

``outbox parked retry`` held its transaction, and with it the parked message's
inbox row, across the wait for the broker's confirm: when the confirm never came (a
proxy that drops ``basic.ack``) or the process was stopped (Ctrl-Z) after sending,
the consumer that received the copy waited on that row (``Lock/transactionid``, no
``lock_timeout``) and every message behind it waited too: 0 of 5 applied in 60 s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox.amqp.message import InboxMessage
from outbox.db import inbox as inbox_store
from outbox.db.inbox import ParkedStore
from outbox.inbox.process import Inbox
from tests.fixtures.faults import TcpProxy, proxied_amqp_url, wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.test_inbox import (
    INBOX,
    consumer_settings,
    effects,
    new_ids,
    publish,
    record,
    running,
)

# The consumer's lock_timeout in these tests (seconds): short, so the held message
# comes round several times within a test.
LOCK_TIMEOUT = 1.0

# ``outbox parked retry`` as releases before this one ran it: one transaction from the
# removal of the parked row and its inbox id to after the publish; stopped (as by
# Ctrl-Z) after the publish, before the commit.  SIGCONT lets it commit.
OLD_RETRY = r"""
import os, signal, sys
import pika, psycopg
dsn, url, queue, message_id = sys.argv[1:5]
with psycopg.connect(dsn) as conn:
    conn.execute("DELETE FROM inbox_parked WHERE message_id = %s", [message_id])
    conn.execute("DELETE FROM inbox WHERE message_id = %s", [message_id])
    channel = pika.BlockingConnection(pika.URLParameters(url)).channel()
    channel.confirm_delivery()
    properties = pika.BasicProperties(message_id=message_id, delivery_mode=2)
    channel.basic_publish("", queue, b"fixed", properties)
    print("sent", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    conn.commit()
print("committed", flush=True)
"""

# AMQP basic.ack: class 60, method 80, as they follow a method frame's header.
BASIC_ACK = b"\x00\x3c\x00\x50"


class AckDroppingProxy(TcpProxy):
    """Forwards everything until the broker sends a ``basic.ack``; from then on
    nothing the broker sends reaches the client, and the connection stays open (a
    confirm that never comes, not a cut connection)."""

    def __init__(self, host: str, port: int) -> None:
        self.dropped = False
        super().__init__(host, port)

    def _downstream(self, pair: Any) -> None:
        with contextlib.suppress(OSError):
            while data := pair.server.recv(65536):
                if self.dropped or BASIC_ACK in data:
                    self.dropped = True
                    continue
                pair.client.sendall(data)
        pair.cut()


@pytest.fixture
def short_lock_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inbox_store, "INBOX_LOCK_TIMEOUT", LOCK_TIMEOUT)


def parked_inbox(topology: Topology, consumer_dsn: str) -> tuple[Inbox, str, set[str]]:
    """A running consumer's parts: the Inbox (not started), one message parked by it,
    and the set of ids its handler refuses (empty once the message is parked)."""
    refused: set[str] = set()

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        if message.message_id in refused:
            raise ValueError("refused for now")
        record(conn, message)

    [parked] = new_ids(1)
    refused.add(parked)
    inbox = Inbox(handler, consumer_settings(topology, consumer_dsn, max_attempts=1))
    return inbox, parked, refused


def applied(consumer_dsn: str, ids: list[str]) -> int:
    done = {message_id for message_id, _ in effects(consumer_dsn)}
    return sum(1 for i in ids if i in done)


@contextlib.contextmanager
def subprocess_of(args: list[str], env: dict[str, str] | None = None) -> Iterator[Any]:
    """A subprocess, killed (after SIGCONT) if still running when the block ends."""
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
        proc.communicate(timeout=30)


def test_consumer__a_row_held_by_a_stopped_old_release_retry_stalls_only_its_message(
    topology: Topology, consumer_dsn: str, short_lock_timeout: None
) -> None:
    """A stopped `parked retry` of an older release holds the parked message's inbox
    row with its copy on the queue: the consumer puts that copy back (no attempt
    counted, not parked), applies the 5 messages behind it, and applies the copy
    once the holder commits."""
    inbox, parked, refused = parked_inbox(topology, consumer_dsn)
    publish(topology, [(parked, b"broken")])
    with running(inbox):
        wait_for(lambda: inbox.stats.parked == 1, 20, "the message to be parked")
        refused.clear()  # the handler is fixed
        args = [sys.executable, "-c", OLD_RETRY, consumer_dsn, topology.amqp_url]
        with subprocess_of([*args, topology.queue, parked]) as old_retry:
            assert old_retry.stdout is not None
            assert old_retry.stdout.readline().strip() == "sent"  # and stopped itself
            later = new_ids(5)
            publish(topology, [(i, b"later") for i in later])
            wait_for(
                lambda: applied(consumer_dsn, later) == 5,
                10 * LOCK_TIMEOUT + 10,
                "the 5 messages behind the held one to be applied",
            )
            assert applied(consumer_dsn, [parked]) == 0  # its row is still held
            assert (inbox.stats.handler_failures, inbox.stats.parked) == (1, 1)
            old_retry.send_signal(signal.SIGCONT)
            assert old_retry.wait(timeout=20) == 0
        wait_for(lambda: applied(consumer_dsn, [parked]) == 1, 20, "the copy to be applied")
        assert (inbox.stats.handler_failures, inbox.stats.parked) == (1, 1)
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted([parked, *later])
    with psycopg.connect(consumer_dsn) as conn:
        assert conn.execute(f"SELECT count(*) FROM {INBOX}_parked").fetchone() == (0,)
        assert conn.execute(f"SELECT count(*) FROM {INBOX}_attempts").fetchone() == (0,)


@pytest.mark.parametrize("stopped", [False, True], ids=["waiting", "stopped"])
def test_parked_retry__a_confirm_that_never_comes_stalls_neither_it_nor_the_consumer(
    topology: Topology, consumer_dsn: str, short_lock_timeout: None, stopped: bool
) -> None:
    """`outbox parked retry` through a proxy that drops basic.ack (and, ``stopped``,
    then stopped with SIGSTOP as by Ctrl-Z): it gives up after --publish-timeout
    (exit 6, one line), holding nothing meanwhile; the consumer applies the copy and
    the 5 messages behind it; the message stays listed, and a second retry sends a
    copy the inbox skips."""
    inbox, parked, refused = parked_inbox(topology, consumer_dsn)
    publish(topology, [(parked, b"broken")])
    host, port = "127.0.0.1", int(topology.amqp_url.rsplit(":", 1)[1].split("/")[0])
    proxy = AckDroppingProxy(host, port)
    env = {
        **os.environ,
        "OUTBOX_DSN": consumer_dsn,
        "OUTBOX_AMQP_URL": proxied_amqp_url(topology.amqp_url, proxy),
        "OUTBOX_INBOX_TABLE": INBOX,
        "OUTBOX_PUBLISH_TIMEOUT": "3",
    }
    retry = [sys.executable, "-m", "outbox", "parked", "retry", "--all"]
    try:
        with running(inbox):
            wait_for(lambda: inbox.stats.parked == 1, 20, "the message to be parked")
            refused.clear()
            with subprocess_of(retry, env) as stalled:
                wait_for(lambda: proxy.dropped, 20, "the broker's basic.ack (dropped)")
                if stopped:
                    stalled.send_signal(signal.SIGSTOP)
                later = new_ids(5)
                publish(topology, [(i, b"later") for i in later])
                wait_for(
                    lambda: applied(consumer_dsn, [parked, *later]) == 6,
                    20,
                    "the copy and the 5 messages behind it to be applied",
                )
                if stopped:
                    stalled.send_signal(signal.SIGCONT)
                _out, err = stalled.communicate(timeout=20)
            assert stalled.returncode == 6, err
            assert "Traceback" not in err
            assert "did not confirm a message" in err.splitlines()[0], err
            assert "--publish-timeout" in err
            store = ParkedStore(consumer_dsn, INBOX)
            try:
                assert [e["message_id"] for e in store.entries(10)] == [parked]
                del env["OUTBOX_AMQP_URL"]
                env["OUTBOX_AMQP_URL"] = topology.amqp_url
                again = subprocess.run(retry, env=env, capture_output=True, text=True, timeout=60)
                assert again.returncode == 0, again.stderr
                wait_for(lambda: inbox.stats.duplicates_skipped == 1, 20, "the 2nd copy skipped")
                assert store.entries(10) == []
            finally:
                store.close()
    finally:
        proxy.close()
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted([parked, *later])
