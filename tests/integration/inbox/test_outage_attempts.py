"""Issue 18, item 1: only a real outage of the consumer's own servers is retried as
an outage, and the message in hand still gets its attempt counted."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from outbox.amqp.message import InboxMessage
from outbox.inbox.process import Inbox
from tests.fixtures.faults import TcpProxy, proxied_dsn, wait_for
from tests.fixtures.servers import Topology
from tests.integration.inbox.test_inbox import (
    consumer_settings,
    effects,
    new_ids,
    publish,
    record,
    running,
)


def test_outage__the_message_in_hand_counts_its_attempt_once_the_database_is_back(
    topology: Topology, consumer_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    info = psycopg.conninfo.conninfo_to_dict(consumer_dsn)
    target = (str(info.get("host", "127.0.0.1")), int(info.get("port", 5432)))
    proxy = TcpProxy(*target)
    cut = threading.Event()

    def handler(conn: psycopg.Connection[Any], message: InboxMessage) -> None:
        if message.body == b"in hand" and not cut.is_set():
            cut.set()
            proxy.target = ("127.0.0.1", 1)  # the server is unreachable from now on
            proxy.cut_all()
            threading.Timer(1.0, lambda: setattr(proxy, "target", target)).start()
        record(conn, message)

    try:
        ids = new_ids(3)
        inbox = Inbox(
            handler,
            consumer_settings(topology, proxied_dsn(consumer_dsn, proxy), max_attempts=3),
        )
        publish(topology, [(ids[0], b"in hand"), (ids[1], b"x"), (ids[2], b"y")])
        with running(inbox):
            wait_for(lambda: len(effects(consumer_dsn)) == 3, 30, "3 effects")
            time.sleep(0.3)
    finally:
        proxy.close()
    assert sorted(m for m, _ in effects(consumer_dsn)) == sorted(ids)
    assert inbox.stats.reconnects >= 1  # an outage, retried as one
    assert inbox.stats.handler_failures == 1  # and the attempt of the message in hand
    counted = [
        r.getMessage() for r in caplog.records if "consumer.handler_failed" in r.getMessage()
    ]
    assert len(counted) == 1 and ids[0] in counted[0]
    assert "then the database was unreachable" in counted[0]
