"""The publisher's hand-decoded confirms and loop-free writes under the broker's
less usual answers: nacks, a channel the broker closes mid-batch, confirm-only
traffic past the heartbeat timeout, batches larger than the socket buffer, and a
connection cut right after a send."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator

import pika
import pytest

from outbox.amqp.confirms import Outcome, Pending
from outbox.amqp.frames import Message
from outbox.amqp.publisher import Publisher
from outbox.db.devcluster import free_port
from tests.fixtures.faults import RabbitNode, TcpProxy, proxied_amqp_url
from tests.fixtures.servers import Topology
from tests.fixtures.tls import CertificateAuthority, rabbitmq_tls_listener
from tests.fixtures.wire import count_decoded_confirms


@pytest.fixture
def capped_queue(topology: Topology) -> Iterator[str]:
    """An exchange bound to a queue that holds 3 messages and nacks the rest."""
    name = f"adv-capped-{uuid.uuid4().hex[:8]}"
    conn = pika.BlockingConnection(pika.URLParameters(topology.amqp_url))
    channel = conn.channel()
    channel.exchange_declare(name, "fanout")
    channel.queue_declare(name, arguments={"x-max-length": 3, "x-overflow": "reject-publish"})
    channel.queue_bind(name, name)
    yield name
    channel.queue_delete(name)
    channel.exchange_delete(name)
    conn.close()


def settle_by_collecting(publisher: Publisher, pending: Pending) -> None:
    """Only ``collect_confirms`` runs the connection (as between the relay's steps):
    it must finish writing ``pending`` and take every confirm, all accepted."""
    deadline = time.monotonic() + 15
    while not pending.settled and time.monotonic() < deadline:
        publisher.collect_confirms()
        time.sleep(0.0005)
    assert pending.settled, "collect_confirms alone never finished the send"
    assert {d.outcome for d in publisher.confirmed(pending, 1)} == {Outcome.ACCEPTED}


def test_nacks_decoded_by_hand_are_nacks_not_acks(topology: Topology, capped_queue: str) -> None:
    """Catches a decoder that takes basic.nack (method 120) for an ack, or drops the
    nack's multiple bit: the refused messages would count as accepted (lost)."""
    publisher = Publisher(topology.amqp_url)
    decoded = count_decoded_confirms(publisher)
    publisher.connect()
    try:
        outcomes = []
        for batch in range(4):
            messages = [Message(capped_queue, "", b"x", f"n{batch}-{i}") for i in range(5)]
            outcomes += [d.outcome for d in publisher.publish(messages, timeout=10)]
        assert outcomes.count(Outcome.ACCEPTED) == 3
        assert outcomes.count(Outcome.NACKED) == 17
        assert sum(decoded) > 0, "no confirm took the fast path"
    finally:
        publisher.close()


def test_channel_closed_by_the_broker_mid_batch_then_reopened(topology: Topology) -> None:
    """A publish to a missing exchange closes the channel (404) with confirms in flight;
    the next batch reuses the channel number.  Catches confirms of the old channel
    taken for the new one's (same number, tags from 1 again) and a decoder still
    matching a channel that is gone."""
    publisher = Publisher(topology.amqp_url)
    decoded = count_decoded_confirms(publisher)
    publisher.connect()
    try:
        first_number = publisher._channel.channel_number
        for round_ in range(5):
            good = [Message(topology.exchange, "k", b"x", f"a{round_}-{i}") for i in range(20)]
            bad = [Message(f"no-such-{uuid.uuid4().hex}", "k", b"x", f"bad{round_}")]
            after = [Message(topology.exchange, "k", b"x", f"b{round_}-{i}") for i in range(20)]
            deliveries = publisher.publish(good + bad + after, timeout=10)
            outcomes = [d.outcome for d in deliveries]
            # Nothing after the refused message can be confirmed; before it, acks or doubt.
            assert set(outcomes[:20]) <= {Outcome.ACCEPTED, Outcome.UNKNOWN}, outcomes
            assert set(outcomes[20:]) == {Outcome.UNKNOWN}, outcomes
            assert publisher.connected
            again = [Message(topology.exchange, "k", b"y", f"c{round_}-{i}") for i in range(30)]
            assert [d.outcome for d in publisher.publish(again, timeout=10)] == [
                Outcome.ACCEPTED
            ] * 30
            assert publisher._channel.channel_number == first_number
        assert sum(decoded) > 0
    finally:
        publisher.close()
    arrived = [p.message_id for _, p, _ in topology.messages()]
    assert len(arrived) == len(set(arrived))
    assert sum(1 for m in arrived if m.startswith("c")) == 150
    assert not [m for m in arrived if m.startswith("b") or m.startswith("bad")]


def test_confirm_only_traffic_past_the_heartbeat_timeout_keeps_the_connection(
    topology: Topology,
) -> None:
    """With a 1 s heartbeat and nothing but acks coming in (the broker sends no
    heartbeat while it sends acks), pika's checker sees traffic only through
    ``bytes_received``.  Catches the fast path not counting the bytes it reads: the
    connection is torn down at the first check (timeout + 5 s)."""
    url = topology.amqp_url + ("&" if "?" in topology.amqp_url else "?") + "heartbeat=1"
    publisher = Publisher(url)
    decoded = count_decoded_confirms(publisher)
    publisher.connect()
    try:
        deadline = time.monotonic() + 13.0  # checks at 6 s (handshake bytes) and 12 s
        sent = 0
        while time.monotonic() < deadline:
            messages = [Message(topology.exchange, "k", b"x", f"h{sent + i}") for i in range(5)]
            outcomes = {d.outcome for d in publisher.publish(messages, timeout=10)}
            assert outcomes == {Outcome.ACCEPTED}, publisher._failure
            sent += 5
            publisher.wait(0.05)
        assert publisher.connected, publisher._failure
        assert len(decoded) > 50, "the acks did not take the fast path"
        assert publisher._conn is not None and publisher._conn._heartbeat_checker is not None
    finally:
        publisher.close()


def test_a_batch_larger_than_the_socket_buffer_goes_out_whole(topology: Topology) -> None:
    """``_Wire.flush`` writes what the socket takes and leaves the rest to the loop.
    Catches a flush that drops the remainder of a partial write, or a ``quiet`` that
    reports an idle socket while writes are still buffered (``collect_confirms``
    would then never push the rest out)."""
    publisher = Publisher(topology.amqp_url)
    publisher.connect()
    try:
        body = b"z" * 16384
        messages = [Message(topology.exchange, "k", body, f"big{i}") for i in range(600)]
        # ~10 MB: far more than a socket buffer
        settle_by_collecting(publisher, publisher.send(messages))
    finally:
        publisher.close()
    assert len(topology.messages(idle=1.0)) == 600


def test_connection_cut_right_after_a_send(topology: Topology, amqp_proxy: TcpProxy) -> None:
    """The connection goes as the loop-free send returns: nothing raises, every
    message is accepted or in doubt, and what was accepted arrived.  Catches a flush
    or quiet that crashes on a failed transport, or confirms invented for it.  How
    many acks reach the client before the cut varies: attempts go on until some had
    accepted messages (or 30 were made), so ``accepted <= arrived`` is checked on
    real acks, not only on an empty set."""
    with_acks = 0
    seen: list[tuple[int, int]] = []  # (accepted, arrived) per attempt
    for attempt in range(30):
        publisher = Publisher(proxied_amqp_url(topology.amqp_url, amqp_proxy))
        publisher.connect()
        try:
            messages = [
                Message(topology.exchange, "k", b"c" * 2000, f"cut{attempt}-{i}")
                for i in range(300)
            ]
            replied = amqp_proxy.downstream_bytes
            pending = publisher.send(messages)
            # Cut once the broker's first acks went through to the client, unread.
            deadline = time.monotonic() + 10
            while amqp_proxy.downstream_bytes == replied and time.monotonic() < deadline:
                time.sleep(0.001)
            amqp_proxy.cut_all()
            publisher.collect_confirms()
            deliveries = publisher.confirmed(pending, 5)
            assert {d.outcome for d in deliveries} <= {Outcome.ACCEPTED, Outcome.UNKNOWN}
            assert not publisher.connected
            accepted = {
                f"cut{attempt}-{i}"
                for i, d in enumerate(deliveries)
                if d.outcome is Outcome.ACCEPTED
            }
        finally:
            publisher.close()
        arrived = {p.message_id for _, p, _ in topology.messages()}
        assert accepted <= arrived
        seen.append((len(accepted), len(arrived)))
        with_acks += bool(accepted)
        if with_acks >= 2:
            break
    print(f"accepted, arrived per attempt: {seen}")
    assert with_acks, f"no ack reached the client before the cut in 30 attempts: {seen}"


# -- TLS: flush falls back to a pass of the loop; quiet must see SSL's own buffer ---------
@dataclasses.dataclass(frozen=True)
class TlsBroker:
    url: str  # amqps, verified against ``ca``
    ca: str
    topology: Topology  # the same node through its plain listener


@pytest.fixture(scope="module")
def tls_broker() -> Iterator[TlsBroker]:
    folder = tempfile.mkdtemp(prefix="outbox-adv-tls-")
    os.chmod(folder, 0o755)
    ca = CertificateAuthority(folder, "adv-ca")
    server = ca.server_certificate("server", dns=["localhost"], ips=["127.0.0.1"])
    port = free_port()
    node = RabbitNode(rabbitmq_tls_listener(port, ca, server))
    try:
        node.start()
        suffix = uuid.uuid4().hex[:8]
        topology = Topology(node.url, f"a.ex.{suffix}", f"a.q.{suffix}", f"a.l.{suffix}")
        topology.declare()
        yield TlsBroker(f"amqps://guest:guest@localhost:{port}/%2F", ca.cert, topology)
    finally:
        node.destroy()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("size, count", [(16384, 600), (10, 2000)])
def test_tls__collect_confirms_alone_finishes_sends(
    tls_broker: TlsBroker, size: int, count: int
) -> None:
    """Over TLS ``_Wire.flush`` declines and ``collect_confirms`` runs a loop pass only
    when ``quiet`` says something waits.  Confirms decrypted into the SSL object's
    buffer are invisible to ``select``; writes may wait on an SSL renegotiation read.
    Catches a ``quiet`` that reports idle then: the sends would never settle here
    (nothing else drives the loop).  Large messages (a partial SSL write) and many
    small ones (many ack records in one read)."""
    topology = tls_broker.topology
    publisher = Publisher(tls_broker.url, ca_file=tls_broker.ca)
    decoded = count_decoded_confirms(publisher)
    publisher.connect()
    try:
        for round_ in range(3):
            messages = [
                Message(topology.exchange, "k", b"t" * size, f"t{round_}-{i}") for i in range(count)
            ]
            settle_by_collecting(publisher, publisher.send(messages))
        assert sum(decoded) > 0
    finally:
        publisher.close()
    assert len(topology.messages(idle=1.0)) == 3 * count
