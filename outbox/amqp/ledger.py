"""Broker-side evidence that a batch was fully accepted.

The ledger is a RabbitMQ stream queue (durable, append-only, readable without
being consumed).  After every message of a batch is confirmed (or recorded as a
dead letter), the relay appends ``{"gid": …}`` to it and waits for that confirm;
only then does it run COMMIT PREPARED.  A gid in the ledger is therefore positive
evidence that the whole batch is safe on the broker, and a resolver commits only
gids it finds there (docs/explanation/guarantee.md).

This module owns the ledger: the record format, the probe, and reading the
finished gids back (``finished_gids``, over ``publisher.read_stream``, the one
place that reads a stream with pika).  Records are published to the default
exchange with the stream's name as routing key.

Retention is the stream's ``x-max-age`` (7 days by default): far longer than any
batch stays in doubt.
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import Iterable

from outbox import urls
from outbox.amqp import failover
from outbox.amqp.frames import Message
from outbox.amqp.publisher import read_stream
from outbox.errors import BrokerUnavailable, InvalidSetting

FORMAT_VERSION = 1


def record(gid: str, *, queue: str, rows: int, dead: int, relay_id: str) -> Message:
    """The evidence that batch ``gid`` is wholly on the broker, for the stream ``queue``."""
    body = json.dumps(
        {"v": FORMAT_VERSION, "gid": gid, "rows": rows, "dead": dead, "relay": relay_id},
        separators=(",", ":"),
    ).encode()
    return Message(exchange="", routing_key=queue, body=body, message_id=f"ledger:{gid}")


def probe(queue: str) -> Message:
    """A record with no gid: proves the ledger takes writes (``gids_in`` skips it)."""
    body = json.dumps({"v": FORMAT_VERSION, "probe": str(uuid.uuid4())}).encode()
    return Message(
        exchange="", routing_key=queue, body=body, message_id=f"ledger-probe:{uuid.uuid4()}"
    )


def gids_in(bodies: Iterable[bytes]) -> set[str]:
    """The gids recorded in ledger bodies (probes and foreign records are skipped)."""
    found = set()
    for body in bodies:
        try:
            entry = json.loads(body)
        except ValueError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("gid"), str):
            found.add(entry["gid"])
    return found


def finished_gids(
    amqp_url: str,
    queue: str,
    *,
    since: datetime.datetime | None,
    timeout: float = 30.0,
    connect_timeout: float = 10.0,
    ca_file: str | None = None,
) -> set[str]:
    """Every gid recorded in the ledger from ``since`` up to now.

    Read through the first node of ``amqp_url`` that answers (a ``;`` list of a
    cluster's nodes), moving on to the next when one fails.  With several nodes,
    rounds over them are repeated for up to ``timeout`` seconds: when a node dies
    the streams it led elect new leaders within about a second, and until then a
    read may fail on every node (RabbitMQ 3.10 closes the connection, 541, on a
    publish to a stream whose leader just died).  With one node, one try.
    """
    try:
        nodes = [node.text for node in urls.parse_amqp_urls(amqp_url)]
    except urls.InvalidUrl as exc:
        raise InvalidSetting(
            f"the RabbitMQ URL is not valid: {exc}", "check --amqp-url / OUTBOX_AMQP_URL"
        ) from None
    deadline = time.monotonic() + timeout
    round_number = 0
    while True:
        failures: list[BrokerUnavailable] = []
        for node in nodes:
            probe = json.dumps({"v": FORMAT_VERSION, "probe": str(uuid.uuid4())}).encode()
            try:
                return gids_in(
                    read_stream(
                        node,
                        queue,
                        since=since,
                        probe=probe,
                        timeout=timeout,
                        connect_timeout=connect_timeout,
                        ca_file=ca_file,
                    )
                )
            except BrokerUnavailable as exc:
                failures.append(exc)
        if len(nodes) == 1:
            raise failures[0]
        if time.monotonic() >= deadline:
            raise BrokerUnavailable(
                f"cannot read the ledger through any RabbitMQ node: "
                f"{'; '.join(f.message for f in failures)}",
                failures[-1].hint,
            )
        time.sleep(
            failover.reconnect_delay(
                round_number, nodes=len(nodes), node_lost=False, initial=0.1, maximum=1.0
            )
        )
        round_number += 1
