"""The invariant, as a property: every committed row ends in exactly one place.

Random mixes of good and bad rows (names and keys valid and invalid, headers of
random JSON shapes and sizes up to and past the frame limit, payload sizes,
extreme timestamps, shared message_ids, content types, ordering keys) are committed
while ONE relay keeps running.  After each mix, once the outbox is empty: every row
was delivered exactly once or is a dead letter with a reason, never both, never
neither; nothing is left prepared; the relay is still running.  Per ordering key
(dead letters hold their key, the default): the key's messages arrived in id order,
and after its first dead letter every later row of the key is a dead letter too.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from outbox.config import Settings
from outbox.message import MAX_HEADER_DEPTH
from tests.fixtures.faults import prepared_left
from tests.fixtures.servers import Topology
from tests.integration.relay.test_bad_rows import RunningRelay

GOOD, BAD, EITHER = "good", "bad", "either"  # EITHER: at the edge of the frame limit
FRAME_MAX = 131072


@dataclasses.dataclass(frozen=True)
class Part:
    """One column's value for a row, and what it makes of the row."""

    value: Any
    verdict: str


def worst(*verdicts: str) -> str:
    return BAD if BAD in verdicts else EITHER if EITHER in verdicts else GOOD


json_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
)
json_objects = st.dictionaries(
    st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=10
    ).filter(lambda k: k not in ("CC", "BCC")),
    st.recursive(
        json_leaves,
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.text(max_size=5).filter(lambda k: "\x00" not in k), inner, max_size=3
            )
        ),
        max_leaves=12,
    ),
    max_size=4,
)


def nested(depth: int) -> str:
    return '{"d": ' + "[" * depth + "]" * depth + "}"


headers = st.one_of(
    st.just(Part(None, GOOD)),
    json_objects.map(lambda h: Part(json.dumps(h), GOOD)),
    st.just(Part(json.dumps({"CC": ["a.b"], "tenant": "ünïcødé ✓"}), GOOD)),
    st.sampled_from([1_000, 60_000, 120_000]).map(
        lambda n: Part(json.dumps({"big": "v" * n}), GOOD)
    ),
    st.integers(FRAME_MAX - 200, FRAME_MAX + 50).map(
        lambda n: Part(json.dumps({"big": "v" * n}), EITHER)
    ),
    st.sampled_from([FRAME_MAX + 500, 200_000]).map(
        lambda n: Part(json.dumps({"big": "v" * n}), BAD)
    ),
    st.sampled_from(
        [
            json.dumps({"price": 1.5}),
            json.dumps({"n": 2**64}),
            json.dumps({"CC": "not-an-array"}),
            json.dumps({"k" * 256: 1}),
            json.dumps(["not", "an", "object"]),
            json.dumps("a string"),
            nested(MAX_HEADER_DEPTH + 5),
            nested(1000),  # past Python's recursion limit: cannot even be loaded
        ]
    ).map(lambda text: Part(text, BAD)),
)
created_at = st.one_of(
    st.just(Part(None, GOOD)),  # now()
    st.sampled_from(
        ["1970-01-01 00:00:00+00", "9999-12-31 23:59:59+00", "2001-02-03 04:05:06.789+07"]
    ).map(lambda v: Part(v, GOOD)),
    st.sampled_from(
        [
            "infinity",
            "-infinity",
            "0001-01-01 00:00:00+00",
            "1969-12-31 23:59:59+00",
            "20000-01-01 00:00:00+00",
        ]
    ).map(lambda v: Part(v, BAD)),
)
content_type = st.one_of(
    st.just(Part(None, GOOD)),
    st.sampled_from(["application/json", "text/plain; charset=utf-8", "x/ünï ✓"]).map(
        lambda v: Part(v, GOOD)
    ),
    st.just(Part("t" * 255, GOOD)),
    st.just(Part("t" * 256, BAD)),
)
payload_size = st.one_of(st.integers(0, 64), st.sampled_from([4096, 65_536]), st.just(1024 * 1024))


@dataclasses.dataclass
class Row:
    exchange: str
    routing_key: str
    destination: str  # its verdict
    headers: Part
    created_at: Part
    content_type: Part
    payload: bytes
    message_id: uuid.UUID
    ordering_key: str | None = None
    id: int = 0

    @property
    def verdict(self) -> str:
        parts = (self.headers, self.created_at, self.content_type)
        return worst(self.destination, *(p.verdict for p in parts))

    @property
    def key(self) -> tuple[str, bytes]:
        return str(self.message_id), self.payload


@st.composite
def rows(draw: st.DrawFn, topology: Topology) -> list[Row]:
    shared = [uuid.uuid4(), uuid.uuid4()]
    # Fresh key names per mix: a dead letter of an earlier mix would hold them.
    keys = [None, f"a.{uuid.uuid4().hex[:6]}", f"b.{uuid.uuid4().hex[:6]}"]
    missing = f"{topology.exchange}.missing.{uuid.uuid4().hex[:6]}"
    destinations = [
        (topology.exchange, "k.ok", GOOD),
        (topology.exchange, "é" * 127 + "k", GOOD),  # 255 bytes
        ("", topology.queue, GOOD),
        (missing, "k", BAD),  # no such exchange
        ("", f"nowhere.{uuid.uuid4().hex}", BAD),  # unroutable (returned)
        ("amq.direct", f"nobody.{uuid.uuid4().hex}", BAD),  # exists, no binding
        ("x" * 256, "k", BAD),  # name too long
        ("bad name with spaces ✗", "k", BAD),
        (topology.exchange, "r" * 256, BAD),  # routing key too long
    ]
    made = []
    for _ in range(draw(st.integers(1, 8))):
        exchange, routing_key, verdict = draw(st.sampled_from(destinations))
        size = draw(payload_size)
        # A row is identified by (message_id, payload): rows may share a message_id
        # when their payloads carry a unique tag; shorter payloads get their own id.
        if size >= 16:
            payload = uuid.uuid4().bytes + b"p" * (size - 16)
            message_id = draw(st.sampled_from(shared))
        else:
            payload, message_id = b"p" * size, uuid.uuid4()
        made.append(
            Row(
                exchange,
                routing_key,
                verdict,
                draw(headers),
                draw(created_at),
                draw(content_type),
                payload,
                message_id,
                draw(st.sampled_from(keys)),
            )
        )
    return made


def insert(dsn: str, batch: list[Row], commits: int) -> None:
    """Commit the rows in ``commits`` transactions; each row learns its id."""
    step = max(1, -(-len(batch) // commits))
    with psycopg.connect(dsn) as conn:
        for start in range(0, len(batch), step):
            with conn.transaction():
                for row in batch[start : start + step]:
                    [(row.id,)] = conn.execute(
                        "INSERT INTO outbox (message_id, exchange, routing_key, payload, "
                        "headers, content_type, created_at, ordering_key) VALUES (%s, %s, %s, "
                        "%s, %s::jsonb, %s, coalesce(%s::timestamptz, now()), %s) RETURNING id",
                        [
                            row.message_id,
                            row.exchange,
                            row.routing_key,
                            row.payload,
                            row.headers.value,
                            row.content_type.value,
                            row.created_at.value,
                            row.ordering_key,
                        ],
                    ).fetchall()


def take_messages(topology: Topology) -> list[tuple[str, bytes]]:
    """Everything on the queue now, in order, as (message_id, body); the queue is
    left empty."""
    channel = topology.channel()
    got: list[tuple[str, bytes]] = []
    while True:
        method, props, body = channel.basic_get(topology.queue, auto_ack=True)
        if method is None:
            break
        got.append((props.message_id, body))
    channel.connection.close()
    return got


@pytest.fixture
def running_relay(settings: Settings) -> Iterator[RunningRelay]:
    with RunningRelay(settings) as running:
        yield running


@hypothesis_settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), commits=st.integers(1, 3))
def test_every_committed_row_ends_in_exactly_one_place(
    data: st.DataObject,
    commits: int,
    settings: Settings,
    topology: Topology,
    running_relay: RunningRelay,
) -> None:
    batch = data.draw(rows(topology))
    insert(settings.dsn, batch, commits)

    running_relay.wait_until_empty(settings.dsn, timeout=30)

    assert running_relay.alive, "the relay is still running"
    assert prepared_left(settings.dsn) == [], "nothing left prepared"
    arrived = take_messages(topology)
    delivered = Counter(arrived)
    with psycopg.connect(settings.dsn) as conn:
        letters = {
            row_id: (bytes(payload), reason)
            for row_id, payload, reason in conn.execute(
                "SELECT id, payload, reason FROM outbox_dead_letters WHERE id = ANY(%s)",
                [[r.id for r in batch]],
            ).fetchall()
        }
    assert set(delivered) <= {r.key for r in batch}, "a message nobody committed"
    held = set()  # rows behind a dead letter of their key
    by_key = {r.key: r for r in batch}
    for key in {r.ordering_key for r in batch} - {None}:
        mine = sorted((r for r in batch if r.ordering_key == key), key=lambda r: r.id)
        blocked = False
        for row in mine:
            if blocked:
                held.add(row.id)
                assert row.id in letters, f"row {row.id} went out behind a dead letter of {key}"
            blocked = blocked or row.id in letters
        ids = [by_key[m].id for m in arrived if by_key[m].ordering_key == key]
        assert ids == sorted(ids), f"key {key} arrived out of order: {ids}"
    for row in batch:
        copies, letter = delivered[row.key], letters.get(row.id)
        where = f"row {row.id} ({row.verdict}): {copies} delivered, dead letter {letter}"
        assert (copies, letter is None) in ((1, True), (0, False)), where
        if letter is not None:
            assert letter[0] == row.payload and letter[1].strip(), where
        if row.verdict == GOOD and row.id not in held:
            assert copies == 1, where
        if row.verdict == BAD:
            assert letter is not None, where
