"""Issue 18: whatever a shared queue carries, every delivered message ends in
exactly one place (one committed effect, or parked with the reason), and nothing
a message holds makes the consumer exit, loop or stall the queue.

Each test publishes the hostile message(s) FIRST and good ones behind them: a
crash loop or a stalled queue shows as good messages without effects.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.servers import Topology
from tests.integration.inbox.support import (
    INBOX,
    consumer,
    effect_bodies,
    inbox_key,
    parked_bodies,
    publish,
    rows,
    scalar,
    wait_settled,
)


def good(count: int, tag: str = "g") -> list[tuple[str, bytes]]:
    return [(f"{tag}-{i}", f"ok:{tag}-{i}".encode()) for i in range(count)]


def in_inbox(dsn: str) -> set[str]:
    return {r[0] for r in rows(dsn, f"SELECT message_id FROM {INBOX}")}


@pytest.mark.parametrize(
    "message_id",
    [b"nul\x00inside", b"\xff\xfe-bad", b"\\xlooks-escaped", b"x" * 255],
    ids=["nul", "not-utf8", "escape-prefix", "255-bytes"],
)
def test_hostile_id__is_applied_once_and_a_later_copy_is_skipped(
    topology: Topology, consumer_dsn: str, tmp_path: Path, message_id: bytes
) -> None:
    """A NUL byte (a batch of two or more: "PostgreSQL text fields cannot contain
    NUL", exit 1 on every start) or invalid UTF-8 ("unexpected UnicodeDecodeError")
    in message_id; the id is still deduplicated."""
    publish(topology, [(message_id, b"ok:hostile"), *good(3)])
    with consumer(tmp_path, consumer_dsn, topology) as process:
        wait_settled(consumer_dsn, topology, [b"ok:hostile", *(b for _, b in good(3))], 30)
        publish(topology, [(message_id, b"ok:copy"), *good(2, "h")])
        wait_settled(consumer_dsn, topology, [b for _, b in good(2, "h")], 30)
        assert process.alive()
    assert sorted(effect_bodies(consumer_dsn)) == sorted(
        [b"ok:hostile", *(b for _, b in good(3)), *(b for _, b in good(2, "h"))]
    )
    assert inbox_key(message_id) in in_inbox(consumer_dsn)
    assert scalar(consumer_dsn, "SELECT message_id FROM effects WHERE body = 'ok:hostile'") == (
        inbox_key(message_id)
    )
    assert parked_bodies(consumer_dsn) == []


@pytest.mark.parametrize(
    "headers",
    [
        {"text": "NUL \x00 inside"},
        {"bin": b"\x00\x01"},
        {"nested": {"deeper": [b"\xff", "a\x00b", {"k": b"\x00"}]}, "n": 7},
        {"big": "h" * 100_000},
    ],
    ids=["nul-text", "bytes", "nested", "large"],
)
def test_parking__a_message_with_any_headers_is_parked_and_the_queue_moves_on(
    topology: Topology, consumer_dsn: str, tmp_path: Path, headers: dict[str, object]
) -> None:
    """No message_id (parked at once) and a handler that always fails (parked at
    --max-attempts), with a NUL in a string header or a bytes header:
    "PostgreSQL failed while parking a message: unsupported Unicode escape"."""
    publish(topology, [(None, b"ok:no-id"), ("fails", b"raise:always")], headers=headers)
    publish(topology, good(3))
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=2):
        wait_settled(
            consumer_dsn, topology, [b"ok:no-id", b"raise:always", *(b for _, b in good(3))], 30
        )
    assert sorted(parked_bodies(consumer_dsn)) == [b"ok:no-id", b"raise:always"]
    assert sorted(effect_bodies(consumer_dsn)) == sorted(b for _, b in good(3))


def test_parking__an_error_text_with_a_nul_is_recorded_and_parked(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    publish(topology, [("nul-error", b"raise_nul:x"), *good(3)])
    with consumer(tmp_path, consumer_dsn, topology, max_attempts=2):
        wait_settled(consumer_dsn, topology, [b"raise_nul:x", *(b for _, b in good(3))], 30)
    assert parked_bodies(consumer_dsn) == [b"raise_nul:x"]
    error = scalar(consumer_dsn, f"SELECT error FROM {INBOX}_parked")
    assert "NUL" in error and "\x00" not in error
    assert sorted(effect_bodies(consumer_dsn)) == sorted(b for _, b in good(3))


def test_no_properties__a_bare_message_is_parked(
    topology: Topology, consumer_dsn: str, tmp_path: Path
) -> None:
    ch = topology.channel()
    ch.confirm_delivery()
    ch.basic_publish("", topology.queue, b"ok:bare")  # no properties at all
    ch.connection.close()
    publish(topology, good(2))
    with consumer(tmp_path, consumer_dsn, topology):
        wait_settled(consumer_dsn, topology, [b"ok:bare", *(b for _, b in good(2))], 30)
    assert parked_bodies(consumer_dsn) == [b"ok:bare"]
