"""What a retry queue would cost the consumer, measured on the broker (issue 31).

``python -m outbox.bench.retries [--amqp-url URL] [--long 20] [--short 1]``

``outbox consume`` keeps a failing message in hand, unacked, until its next attempt
(``--retry-delay``, doubling up to ``--retry-delay-max``), while the others go on.  The usual
alternative is a retry queue: the consumer publishes the failing message to a queue
whose messages expire after the delay and are dead-lettered back to the work
queue, then acks the original.  This measures, on the broker given, the two facts
that decided against it, each on a classic and on a quorum retry queue:

- ``head of line``: a message with a ``--long`` expiration (a message on its
  fifth attempt, say), then one with a ``--short`` expiration (a first failure).
  RabbitMQ expires per-message TTLs only at the head of a queue, so the short one
  comes back when the long one does, not after its own delay: the seconds it
  waited are printed.  (One retry queue per delay, with a queue-wide TTL, avoids
  this at the price of a queue per step of the backoff.)
- ``dead-lettered into a full queue``: the work queue at its ``x-max-length``
  with ``x-overflow: reject-publish``, a retry that expires.  Dead-lettering is
  at-most-once by default: whether the message arrived, went anywhere, or was
  dropped is printed.

In hand, a message's next attempt comes after its own delay, whatever other
messages wait, and nothing is republished
(``tests/integration/inbox/test_queue_policies.py``).  A benchmark prints
figures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

import pika

from outbox.config import DEFAULT_AMQP_URL


def _channel(url: str) -> Any:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    channel.confirm_delivery()
    return channel


def _declare(channel: Any, name: str, queue_type: str, arguments: dict[str, Any]) -> None:
    channel.queue_declare(name, durable=True, arguments={"x-queue-type": queue_type, **arguments})


def _publish(channel: Any, queue: str, body: bytes, expiration_ms: int | None = None) -> None:
    properties = pika.BasicProperties(
        delivery_mode=2,
        expiration=None if expiration_ms is None else str(expiration_ms),
    )
    channel.basic_publish("", queue, body, properties)


def _wait_for(channel: Any, queue: str, body: bytes, timeout: float) -> float | None:
    """Seconds until ``body`` is on ``queue`` (taken and acked), None after ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        method, _, received = channel.basic_get(queue)
        if method is None:
            time.sleep(0.02)
            continue
        channel.basic_ack(method.delivery_tag)
        if received == body:
            return time.monotonic() - started
    return None


def head_of_line(url: str, queue_type: str, long_s: float, short_s: float) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    work, retry = f"bench-retries-work-{suffix}", f"bench-retries-retry-{suffix}"
    channel = _channel(url)
    try:
        _declare(channel, work, queue_type, {})
        _declare(
            channel,
            retry,
            queue_type,
            {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": work},
        )
        _publish(channel, retry, b"long", int(long_s * 1000))
        _publish(channel, retry, b"short", int(short_s * 1000))
        waited = _wait_for(channel, work, b"short", long_s * 3 + 10)
        return {"queue_type": queue_type, "delay_s": short_s, "waited_s": waited}
    finally:
        channel.queue_delete(retry)
        channel.queue_delete(work)
        channel.connection.close()


def into_full_queue(url: str, queue_type: str) -> dict[str, Any]:
    suffix = uuid.uuid4().hex[:8]
    work, retry = f"bench-retries-work-{suffix}", f"bench-retries-retry-{suffix}"
    channel = _channel(url)
    try:
        _declare(channel, work, queue_type, {"x-max-length": 1, "x-overflow": "reject-publish"})
        _declare(
            channel,
            retry,
            queue_type,
            {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": work},
        )
        _publish(channel, work, b"filler")
        _publish(channel, retry, b"retry", 200)
        time.sleep(2.0)
        retry_depth = channel.queue_declare(retry, passive=True).method.message_count
        # Room again: a message kept anywhere could now arrive.
        _wait_for(channel, work, b"filler", 5)
        arrived = _wait_for(channel, work, b"retry", 5) is not None
        fate = "arrived" if arrived else ("still waiting" if retry_depth else "dropped")
        return {"queue_type": queue_type, "fate": fate}
    finally:
        channel.queue_delete(retry)
        channel.queue_delete(work)
        channel.connection.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outbox.bench.retries", description=__doc__)
    parser.add_argument("--amqp-url", default=DEFAULT_AMQP_URL)
    parser.add_argument("--long", type=float, default=20.0, help="the first message's delay (s)")
    parser.add_argument("--short", type=float, default=1.0, help="the second message's delay (s)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = {
        "head_of_line": [
            head_of_line(args.amqp_url, kind, args.long, args.short)
            for kind in ("classic", "quorum")
        ],
        "into_full_queue": [into_full_queue(args.amqp_url, kind) for kind in ("classic", "quorum")],
    }
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
        return 0
    print(f"A retry queue, a {args.long:g} s retry then a {args.short:g} s one:")
    print("| retry queue | its own delay | came back after |")
    print("|---|---:|---:|")
    for row in report["head_of_line"]:
        waited = "never" if row["waited_s"] is None else f"{row['waited_s']:.1f} s"
        print(f"| {row['queue_type']} | {row['delay_s']:g} s | {waited} |")
    print()
    print("A retry expiring while the work queue is full (x-overflow: reject-publish):")
    print("| retry queue | the message |")
    print("|---|---|")
    for row in report["into_full_queue"]:
        print(f"| {row['queue_type']} | {row['fate']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
