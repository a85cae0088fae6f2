"""The consumer side's only kombu code (beside the relay's ``publisher``): ``Broker``
consumes (connect, declare, deliver, ack, reject) and ``QueuePublisher`` publishes
for ``outbox parked retry``.

kombu and py-amqp errors come out as ``BrokerUnavailable`` (or ``QueueMissing``).

py-amqp decodes each delivery's property list with UTF-8 inside the connection's
frame reader, so a ``message_id`` that is not UTF-8 raised out of ``drain`` on
every start.  The consumer's connection reads frames with ``frame_handler``
below instead: the same reader, whose messages decode their properties with
``outbox.amqp.properties`` (which never fails on text) and keep the raw
property list for parking.  The same reader also keeps what py-amqp and kombu
would change or choke on: an exchange or routing key that is not UTF-8 (py-amqp
decodes the deliver method strictly) and the body exactly as it arrived (py-amqp
decodes it to ``str`` when ``content_encoding`` names a text codec, kombu
decompresses it when a ``compression`` header is set, an empty one is ``''``).

Frames come off the socket through ``BufferedFrames``: one ``recv`` of up to 64 KiB
holds dozens of deliveries, parsed from the buffer, where py-amqp reads each frame
with two ``recv`` calls of its exact size (six system calls per message).  It uses
py-amqp's private transport (``sock``, ``_read_buffer``), so it is installed only
where that is found as expected (``BufferedFrames.install``); elsewhere, and over
TLS, py-amqp reads as it always does.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import datetime
import errno
import logging
import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from struct import unpack_from
from typing import Any, Protocol

import amqp
from amqp import spec
from amqp import transport as amqp_transport
from amqp.exceptions import MessageNacked, UnexpectedFrame
from kombu import exceptions as kombu_errors
from kombu.connection import Connection
from kombu.entity import Exchange, Queue
from kombu.messaging import Consumer
from kombu.transport import pyamqp

from outbox.amqp import properties as wire
from outbox.amqp.message import (
    KEPT_PROPERTIES,
    UNREADABLE_PROPERTIES,
    InboxMessage,
    to_inbox_message,
)
from outbox.amqp.policy import (
    PROBE_TYPE,
    QueuePolicy,
    inequivalent,
    policy_from,
    refusal,
)
from outbox.errors import BrokerUnavailable, ConfirmTimedOut, ExitCode, NotTaken, OutboxError
from outbox.events import emit

# The consumer's logger, as everywhere in the consumer (operators filter on it).
log = logging.getLogger("outbox.inbox")

# Where a delivery's raw property list travels from the frame reader to ``Broker``
# (kombu hands the property dict on as it is); removed before anyone sees it.
_RAW = "x-outbox-raw-properties"
# Likewise the body as it arrived, and (exchange, routing key) when not UTF-8.
_BODY = "x-outbox-raw-body"
_ROUTE = "x-outbox-route"


class _Delivery(amqp.Message):  # type: ignore[misc]
    """A py-amqp message whose properties never fail to decode.

    It overrides py-amqp's private ``GenericContent._load_properties``: py-amqp has
    no public way to decode a property list other than strictly as UTF-8.
    tests/integration/inbox/test_library_internals.py pins it (in .ci/matrix too)."""

    route: tuple[str, str] | None = None  # set by ``frame_handler`` (``_route``)

    def _load_properties(self, class_id: int, buf: Any, offset: int) -> int:
        try:
            props, end = wire.decode(buf, offset)
        except Exception as exc:  # a malformed list: park the message, say why
            props, end = {UNREADABLE_PROPERTIES: f"{type(exc).__name__}: {exc}"}, len(buf)
        props[_RAW] = bytes(buf[offset:end])
        if self.route is not None:
            props[_ROUTE] = self.route
        self.properties = props
        return end

    def keep_body(self) -> None:
        """Keep the body as it arrived (py-amqp may decode it in the callback)."""
        body = self.body
        self.properties[_BODY] = body.encode() if isinstance(body, str) else bytes(body)


def _route(method_sig: tuple[int, int], buf: Any) -> tuple[Any, tuple[str, str] | None]:
    """A deliver (or get-ok) method whose exchange or routing key is not UTF-8,
    which py-amqp cannot decode: the method with both emptied, and both as text
    (undecodable bytes as lone surrogates, as header values are shown)."""
    data = bytes(buf)
    offset = 4
    if method_sig == spec.Basic.Deliver:
        offset += 1 + data[offset]  # consumer tag
    elif method_sig != spec.Basic.GetOk:
        return buf, None
    offset += 9  # delivery tag, redelivered
    start = offset
    fields = []
    for _ in range(2):
        fields.append(data[offset + 1 : offset + 1 + data[offset]])
        offset += 1 + data[offset]
    try:
        for field in fields:
            field.decode("utf-8", "surrogatepass")  # as py-amqp decodes it
    except UnicodeDecodeError:
        exchange, routing_key = (f.decode("utf-8", "surrogateescape") for f in fields)
        return data[:start] + b"\x00\x00" + data[offset:], (exchange, routing_key)
    return buf, None


class _Channel(pyamqp.Channel):
    """A channel that stays closed when the broker closes it.

    py-amqp answers a channel.close from the broker with close-ok, then opens the
    channel again at once and waits for its open-ok before it raises the error.
    RabbitMQ's ``consumer_timeout`` closes a channel whose delivery a handler held
    too long, and again at each of its channel ticks until close-ok comes, so a
    handler that ran well past the timeout left dozens of closes in the socket:
    each read while the reopened channel waited for its open-ok, answered and
    reopened again, one frame deeper, until RecursionError (98 closes) ended the
    consumer.  The consumer has no use for the reopened channel (a closed channel
    is an outage: it reconnects), so the channel is only marked closed; it stays
    registered, so the closes still in the socket are answered while the
    connection closes.

    ``_do_revive`` is py-amqp's private step that reopens the channel; py-amqp has
    no option to leave it closed.  tests/integration/inbox/test_library_internals.py
    pins it (in .ci/matrix too)."""

    def _do_revive(self) -> None:
        self.is_open = False


_CONTENT_METHODS = frozenset([spec.Basic.Return, spec.Basic.Deliver, spec.Basic.GetOk])


def frame_handler(connection: Any, callback: Callable[..., Any]) -> Callable[[Any], bool]:
    """py-amqp's ``method_framing.frame_handler`` (5.x), with ``_Delivery`` as the
    message class; passed to ``amqp.Connection(frame_handler=...)``."""
    expected_types: defaultdict[int, int] = defaultdict(lambda: 1)
    partial_messages: dict[int, _Delivery] = {}

    def on_frame(frame: tuple[int, int, Any]) -> bool:
        frame_type, channel, buf = frame
        connection.bytes_recv += 1
        if frame_type not in (expected_types[channel], 8):
            raise UnexpectedFrame(
                f"Received frame {frame_type} while expecting type: {expected_types[channel]}"
            )
        if frame_type == 1:
            method_sig = unpack_from(">HH", buf, 0)
            if method_sig in _CONTENT_METHODS:
                args, route = _route(method_sig, buf)
                partial_messages[channel] = _Delivery(frame_method=method_sig, frame_args=args)
                partial_messages[channel].route = route
                expected_types[channel] = 2
                return False
            callback(channel, method_sig, buf, None)
        elif frame_type == 2:
            msg = partial_messages[channel]
            msg.inbound_header(buf)
            if not msg.ready:
                expected_types[channel] = 3
                return False
            expected_types[channel] = 1
            partial_messages.pop(channel, None)
            msg.keep_body()
            callback(channel, msg.frame_method, msg.frame_args, msg)
        elif frame_type == 3:
            msg = partial_messages[channel]
            msg.inbound_body(buf)
            if not msg.ready:
                return False
            expected_types[channel] = 1
            partial_messages.pop(channel, None)
            msg.keep_body()
            callback(channel, msg.frame_method, msg.frame_args, msg)
        elif frame_type == 8:
            return False
        return True

    return on_frame


# Errors of ``recv`` that do not mean the connection is gone (as py-amqp's).
_UNAVAILABLE = frozenset([errno.EAGAIN, errno.EINTR, errno.ENOENT, errno.EWOULDBLOCK])
_FRAME_END = 0xCE


class BufferedFrames:
    """``read_frame`` for a py-amqp transport on a plain TCP socket: reads what the
    socket has (up to ``chunk`` bytes, at least the rest of the frame in hand) and
    parses frames from that buffer.  What is read and not parsed yet stays in the
    buffer through timeouts (a partial frame is completed by the next call); a
    closed or failed socket is an ``OSError`` as in py-amqp, which also marks
    the transport disconnected."""

    chunk = 65536

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        # Bytes py-amqp has read and not parsed yet come first: its private buffer,
        # taken over here (py-amqp has no public read of its own; ``install`` checks
        # it is there, tests/unit/inbox/test_frames.py pins it, in .ci/matrix too).
        self.buffer: bytes = bytes(transport._read_buffer)
        transport._read_buffer = b""
        self.offset = 0

    @classmethod
    def install(cls, transport: Any) -> BufferedFrames | None:
        """Read ``transport``'s frames through a ``BufferedFrames`` (returned) if
        it is py-amqp's plain TCP transport as this code knows it; None (py-amqp
        reads) otherwise: TLS, another transport, or a py-amqp without these
        private attributes."""
        plain = getattr(amqp_transport, "TCPTransport", None)
        if (
            plain is None
            or type(transport) is not plain
            or not isinstance(getattr(transport, "_read_buffer", None), bytes | bytearray)
            or not isinstance(getattr(transport, "sock", None), socket.socket)
            or not callable(getattr(transport, "read_frame", None))
        ):
            return None
        frames = cls(transport)
        transport.read_frame = frames.read_frame
        return frames

    def read_frame(self) -> tuple[int, int, bytes]:
        buffer, offset = self.buffer, self.offset
        if len(buffer) - offset >= 8:
            frame_type, channel, size = unpack_from(">BHI", buffer, offset)
            end = offset + 7 + size
            if end < len(buffer):
                if buffer[end] != _FRAME_END:
                    raise UnexpectedFrame(
                        f"Received frame_end {buffer[end]:#04x} while expecting 0xce"
                    )
                self.offset = end + 1
                return frame_type, channel, buffer[offset + 7 : end]
        # Not a whole frame in the buffer: read until it is, then parse it above.
        self._fill(7)
        _, _, size = unpack_from(">BHI", self.buffer, 0)
        self._fill(7 + size + 1)
        return self.read_frame()

    def _fill(self, wanted: int) -> None:
        """Read until the buffer holds ``wanted`` bytes from the offset on."""
        buffer = self.buffer[self.offset :]
        self.buffer, self.offset = buffer, 0
        while len(buffer) < wanted:
            sock = self.transport.sock
            if sock is None:
                raise OSError("the connection to RabbitMQ is closed")
            try:
                data = sock.recv(max(wanted - len(buffer), self.chunk))
            except (BlockingIOError, InterruptedError) as exc:
                if isinstance(exc, InterruptedError):
                    continue
                raise TimeoutError() from exc  # non-blocking: nothing more yet
            except TimeoutError:
                raise
            except OSError as exc:
                if exc.errno not in _UNAVAILABLE:
                    self.transport.connected = False
                raise
            if not data:
                self.transport.connected = False
                raise OSError("Server unexpectedly closed connection")
            buffer += data
            self.buffer = buffer


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One delivery: the handler's view of it and the broker's handle to settle it."""

    message: InboxMessage
    handle: Any


def to_delivery(received: Any, queue: str) -> Delivery:
    properties = dict(received.properties or {})
    raw = properties.pop(_RAW, None)
    body = properties.pop(_BODY, received.body)
    delivery_info = received.delivery_info
    route = properties.pop(_ROUTE, None)
    if route is not None:
        delivery_info = {**delivery_info, "exchange": route[0], "routing_key": route[1]}
    message = to_inbox_message(body, properties, delivery_info, queue, raw_properties=raw)
    return Delivery(message, received)


class Heartbeats:
    """Sends the connection's heartbeats from a thread while the loop applies
    messages (``Broker.busy``).  py-amqp sends them only when asked (``drain``
    does), so a handler that ran for two heartbeat intervals got the connection
    closed by the broker: an outage, every message in hand redelivered.

    The thread only writes heartbeat frames, and only between ``start`` and
    ``stop``, while the loop's thread makes no broker call; ``stop`` waits for a
    frame being written.  It never reads: what the broker sends meanwhile (its
    own heartbeats) waits in the socket for the next ``drain``, which reads it
    before py-amqp checks that heartbeats arrived."""

    def __init__(self, connection: Any, interval: float) -> None:
        self._connection = connection
        self._interval = interval
        self._lock = threading.Lock()
        self._busy = threading.Event()
        self._closing = threading.Event()  # set by ``close``: ends the thread at once
        self.sent = 0
        threading.Thread(target=self._run, name="outbox-heartbeats", daemon=True).start()

    def start(self) -> None:
        self._busy.set()

    def stop(self) -> None:
        self._busy.clear()
        with self._lock:  # a frame being written is written
            pass

    def close(self) -> None:
        """The thread ends now, not after its current wait: a consumer that
        reconnects often must not pile up threads waiting out an interval."""
        self._closing.set()
        self._busy.set()  # wakes the thread, which then ends

    def _run(self) -> None:
        while True:
            self._busy.wait()
            if self._closing.is_set():
                return
            # Every half interval: the broker closes a connection silent for two.
            if self._closing.wait(self._interval / 2):
                return
            with self._lock:
                if self._closing.is_set():
                    return
                if not self._busy.is_set():
                    continue
                try:
                    self._connection.send_heartbeat()
                except Exception:  # the loop's next broker call sees the connection gone
                    return
                self.sent += 1


@contextlib.contextmanager
def _nonblocking(conn: Connection) -> Iterator[None]:
    """The socket in non-blocking mode for a run of ``drain_events(timeout=0)``:
    py-amqp then leaves its timeout alone, where it would set it and put it back
    around every frame (two system calls per frame, 8% of a busy consumer)."""
    sock = getattr(getattr(conn.connection, "transport", None), "sock", None)
    if sock is None:
        yield
        return
    previous = sock.gettimeout()
    sock.settimeout(0)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            sock.settimeout(previous)


class QueueMissing(OutboxError):
    """The queue to consume does not exist (and no ``--bind`` asked to declare it)."""

    exit_code = ExitCode.NOT_READY


class QueueRefused(OutboxError):
    """The queue's own policy would lose messages (a stream, a delivery limit of 0)."""

    exit_code = ExitCode.USAGE


def refuse(queue: str, why: str) -> QueueRefused:
    return QueueRefused(
        f"cannot consume queue {queue!r}: {why}",
        "consume a classic or quorum queue bound to the same exchange: "
        "docs/how-to/consuming.md#queue-types-and-their-policies",
    )


# The arguments the consumer asks a refused declare about, each with a value no
# queue of ours has; what the broker answers replaces it (``read_policy``).
_PROBED: dict[str, Any] = {
    "x-queue-type": PROBE_TYPE,
    "x-delivery-limit": -7,
    "x-message-ttl": 2**31 - 7,
    "x-dead-letter-exchange": "\x00outbox-probe",
}


def broker_errors(conn: Connection) -> tuple[type[BaseException], ...]:
    return (
        OSError,
        kombu_errors.KombuError,
        *conn.connection_errors,
        *conn.channel_errors,
    )


class ConsumerOptions(Protocol):
    """What ``Broker`` reads of the consumer's settings (``outbox.inbox.settings.
    ConsumerSettings`` is one: the consumer's settings sit above this layer)."""

    @property
    def queue(self) -> str: ...
    @property
    def amqp_url(self) -> str: ...
    @property
    def prefetch(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def bindings(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def connect_timeout(self) -> float: ...
    @property
    def heartbeat(self) -> int: ...
    @property
    def delivery_limit(self) -> int | None: ...


class Broker:
    """The consumer's broker connection; every kombu call goes through here and its
    errors come out as ``BrokerUnavailable`` (or ``QueueMissing``)."""

    def __init__(self, settings: ConsumerOptions) -> None:
        self.settings = settings
        self.conn: Connection | None = None
        self._consumer: Consumer | None = None
        self._received: list[Any] | None = None
        self._frames: BufferedFrames | None = None  # None: py-amqp reads
        self.policy = QueuePolicy(delivery_limit=settings.delivery_limit)
        self._heartbeats: Heartbeats | None = None
        # Deliveries that arrived while ``resubscribe`` waited for its replies:
        # handed out first by the next ``drain``.
        self._early: list[Any] = []
        # The current subscription's tag, and the delivery tags of its deliveries
        # handed out and not acked yet (``window_in_hand``).
        self._tag: str | None = None
        self._window: list[int] = []
        # Acks of the current subscription's deliveries kept back until it is
        # cancelled (``hold_acks``); None: acks go out at once.
        self._held_acks: list[tuple[Delivery, bool]] | None = None

    def _dispatch(self, delivery: Any) -> None:
        # py-amqp also dispatches deliveries while it waits for a reply (basic.cancel,
        # connection.close).  Only those read by ``drain`` are handed on; the others
        # stay unacked and go back to the queue when the connection closes.
        if self._received is not None:
            self._received.append(delivery)

    @property
    def connected(self) -> bool:
        return self._consumer is not None

    def _translate(self, what: str, exc: BaseException) -> BrokerUnavailable:
        self.close()
        return BrokerUnavailable(
            f"RabbitMQ failed while {what}: {exc!r}",
            "check --amqp-url / OUTBOX_AMQP_URL and that the broker is running",
        )

    def open(self) -> None:
        s = self.settings
        conn = Connection(
            s.amqp_url,
            heartbeat=s.heartbeat,
            connect_timeout=s.connect_timeout,
            transport_options={"frame_handler": frame_handler},
        )
        self.conn = conn
        self._early = []  # a new channel: nothing of an older one is handed out
        errors = broker_errors(conn)
        try:
            # Each of the ';'-separated URLs once; the caller backs off between rounds.
            conn.ensure_connection(
                max_retries=max(len(conn.alt), 1) - 1,
                interval_start=0,
                interval_step=0,
                interval_max=0,
            )
            conn.connection.Channel = _Channel  # the channels opened from now on
            self._frames = BufferedFrames.install(getattr(conn.connection, "transport", None))
            interval = float(getattr(conn.connection, "heartbeat", 0) or 0)
            if interval > 0:
                self._heartbeats = Heartbeats(conn.connection, interval)
            channel = conn.channel()
            if s.bindings:
                channel = self._declare(channel)
            self._check_queue(channel)
            self.policy = self.read_policy(conn)
            why = refusal(self.policy)
            if why is not None:
                raise refuse(s.queue, why)
            consumer = Consumer(
                channel,
                queues=[Queue(s.queue, no_declare=True)],
                on_message=self._dispatch,
                prefetch_count=s.prefetch,
                auto_declare=False,
            )
            consumer.consume()
            self._subscribed(consumer)
        except (QueueMissing, QueueRefused):
            self.close()
            raise
        except errors as exc:
            raise self._translate("connecting", exc) from exc
        self._consumer = consumer

    def read_policy(self, conn: Connection) -> QueuePolicy:
        """The queue's type and the arguments that can drop a message, learnt from
        declares the broker refuses (see ``outbox.amqp.policy``): each refusal
        names one argument that differs and its value, which the next declare
        carries, until a declare is equivalent.  A declare that is refused for
        another reason (no ``configure`` permission) leaves the policy unknown;
        ``--delivery-limit`` still counts."""
        s = self.settings
        version = str((conn.connection.server_properties or {}).get("version", ""))
        asked = dict(_PROBED)
        learnt: dict[str, Any] = {}
        flags = {"durable": True, "auto_delete": False}
        unknown = QueuePolicy(delivery_limit=s.delivery_limit)
        for _ in range(2 * (len(_PROBED) + len(flags))):
            channel = conn.channel()
            try:
                channel.queue_declare(queue=s.queue, arguments={**asked, **learnt}, **flags)
            except Exception as exc:  # a refusal closes the channel
                found = inequivalent(str(getattr(exc, "reply_text", "") or exc))
                if found is None:
                    emit(log, "consumer.queue_policy_unknown", logging.WARNING, error=repr(exc))
                    return unknown
                name, value = found
                asked.pop(name, None)
                if name in flags:
                    flags[name] = value == "true"
                elif value is None:
                    learnt.pop(name, None)
                else:
                    learnt[name] = value
                continue
            with contextlib.suppress(*broker_errors(conn)):
                channel.close()
            policy = policy_from(learnt, stated_limit=s.delivery_limit, broker_version=version)
            emit(log, "consumer.queue_policy", queue=s.queue, policy=policy.describe())
            return policy
        return unknown

    def _check_queue(self, channel: Any) -> None:
        try:
            channel.queue_declare(queue=self.settings.queue, passive=True)
        except Exception as exc:
            if getattr(exc, "code", None) != 404:
                raise
            raise QueueMissing(
                f"queue {self.settings.queue!r} does not exist",
                "declare it and bind it to your exchange, or pass --bind EXCHANGE:KEY",
            ) from exc

    def _declare(self, channel: Any) -> Any:
        """--bind: the queue (durable) and each exchange (durable topic) if missing,
        then the bindings.  Existing ones keep their type and arguments.  Returns the
        channel to go on with: a failed passive declare closes the one it ran on
        (``_Channel`` does not reopen it)."""
        s = self.settings
        conn = self.conn
        assert conn is not None
        try:
            channel.queue_declare(queue=s.queue, passive=True)
        except Exception as exc:
            if getattr(exc, "code", None) != 404:
                raise
            channel = conn.channel()  # a failed passive declare closes the channel
            Queue(s.queue, durable=True, channel=channel).declare()
            emit(log, "consumer.queue_declared", queue=s.queue)
        for exchange, key in s.bindings:
            try:
                channel.exchange_declare(exchange=exchange, type="topic", passive=True)
            except Exception as exc:
                if getattr(exc, "code", None) != 404:
                    raise
                channel = conn.channel()
                Exchange(exchange, type="topic", durable=True, channel=channel).declare()
                emit(log, "consumer.exchange_declared", exchange=exchange, type="topic")
            channel.queue_bind(queue=s.queue, exchange=exchange, routing_key=key)
        return channel

    def drain(self, timeout: float) -> list[Delivery]:
        """The deliveries that arrive within ``timeout`` s, plus whatever else is
        already waiting in the socket (at most ``batch_size``: the rest of the
        prefetch stays there for the next call), without waiting more."""
        conn = self.conn
        if conn is None:
            raise BrokerUnavailable("not connected to RabbitMQ")
        received, self._early = self._early, []
        self._received = received
        batch_size = self.settings.batch_size
        try:
            conn.drain_events(timeout=0 if received else timeout)
            with _nonblocking(conn):
                if self._frames is not None:
                    # The frames straight from the buffer to py-amqp's frame handler:
                    # what ``drain_events(timeout=0)`` does per frame, without its
                    # four calls and the context manager around each read.
                    read, on_frame = self._frames.read_frame, conn.connection.on_inbound_frame
                    while len(received) < batch_size:
                        on_frame(read())
                while len(received) < batch_size:
                    conn.drain_events(timeout=0)
        except TimeoutError:  # socket.timeout: nothing (more) arrived
            pass
        except broker_errors(conn) as exc:
            raise self._translate("receiving", exc) from exc
        finally:
            self._received = None
        self.heartbeat()
        if not received and self._held_acks is not None:
            # Nothing more came: the window may never fill; what was applied is acked.
            self.release_acks()
        current, window = self._tag, self._window
        for r in received:
            if r.delivery_info.get("consumer_tag") == current:
                window.append(r.delivery_info["delivery_tag"])
        return [to_delivery(r, self.settings.queue) for r in received]

    def heartbeat(self) -> None:
        conn = self.conn
        if conn is None:
            return
        try:
            conn.heartbeat_check()
        except broker_errors(conn) as exc:
            raise self._translate("sending a heartbeat", exc) from exc

    def settle(self, delivery: Delivery, *, ack: bool, multiple: bool = False) -> None:
        """Ack (``multiple``: this and every earlier delivery not settled yet), or
        reject with requeue (the message goes back to its queue position)."""
        info = delivery.handle.delivery_info
        if ack and self._held_acks is not None and info.get("consumer_tag") == self._tag:
            self._held_acks.append((delivery, multiple))
            return
        conn = self.conn
        errors = broker_errors(conn) if conn is not None else (OSError,)
        try:
            if ack:
                delivery.handle.ack(multiple=multiple)
            else:
                delivery.handle.reject(requeue=True)
        except errors as exc:
            raise self._translate("acknowledging" if ack else "requeueing", exc) from exc
        # Delivery tags grow on a channel: the window is sorted.
        window, tag = self._window, info["delivery_tag"]
        if multiple:
            del window[: bisect.bisect_right(window, tag)]
        else:
            at = bisect.bisect_left(window, tag)
            if at < len(window) and window[at] == tag:
                del window[at]

    def window_in_hand(self) -> bool:
        """Whether every delivery the current subscription may have unacked
        (``--prefetch``) was handed out and is not acked (its ack kept back
        counts as not acked): then nothing is on its way to it, and a cancel
        returns nothing to the queue (``planning.cancel_returns_deliveries``)."""
        return len(self._window) >= self.settings.prefetch

    def hold_acks(self) -> None:
        """Keep back the acks of the current subscription's deliveries until it is
        cancelled (``resubscribe``), so that its window fills with deliveries in
        hand and nothing is on its way to it any more (``window_in_hand``).  The
        kept-back acks go out with ``resubscribe``, ``release_acks``, a ``drain``
        that received nothing (the window may never fill) and ``stop_consuming``;
        if the channel is lost first, their messages come back, and the inbox
        skips them as duplicates."""
        if self._held_acks is None:
            self._held_acks = []

    def release_acks(self) -> None:
        """The acks kept back by ``hold_acks`` go out; later ones at once again."""
        held, self._held_acks = self._held_acks, None
        for delivery, multiple in held or ():
            self.settle(delivery, ack=True, multiple=multiple)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """The loop applies messages and makes no broker call meanwhile: the
        connection's heartbeats are sent from a thread (``Heartbeats``)."""
        heartbeats = self._heartbeats
        if heartbeats is None:
            yield
            return
        heartbeats.start()
        try:
            yield
        finally:
            heartbeats.stop()

    def subscribed(self, delivery: Delivery) -> bool:
        """Whether ``delivery`` came through the current subscription (it counts
        against that subscription's ``--prefetch``)."""
        tag = delivery.handle.delivery_info.get("consumer_tag")
        return self._consumer is not None and tag == self._tag

    def _subscribed(self, consumer: Consumer) -> None:
        """``consumer`` has just subscribed: a new tag, nothing of it in hand."""
        # kombu's private tag table: its Consumer makes up the tag and tells it
        # nowhere public; the first delivery would, too late for the window.
        # tests/integration/inbox/test_library_internals.py pins it (.ci/matrix too).
        self._tag = next(iter(consumer._active_tags.values()), None)
        self._window = []

    def resubscribe(self) -> None:
        """Cancel the subscription and start a new one on the same channel, with
        a fresh ``--prefetch`` window.

        RabbitMQ counts a consumer's prefetch per subscription (consumer tag): the
        messages the old one delivered stay unacked on the channel, settled by
        their delivery tags as before (or requeued when the channel closes), but
        no longer take the new subscription's slots.  So messages held in hand
        for a retry, or waiting behind one of their ordering key, do not stop the
        healthy ones behind them from being delivered.  Deliveries that arrive
        while this waits for the broker's replies are kept for the next ``drain``.
        Acks kept back (``hold_acks``) go out after the new subscription, as acks
        of the cancelled one.

        On a quorum queue a cancel hands back to the queue what is on its way to
        the subscription (``planning.cancel_returns_deliveries``): the caller
        cancels there only with the window in hand (``window_in_hand``)."""
        conn, consumer = self.conn, self._consumer
        if conn is None or consumer is None:
            raise BrokerUnavailable("not connected to RabbitMQ")
        received: list[Any] = []
        self._received = received
        try:
            consumer.cancel()
            consumer.consume()
            self._subscribed(consumer)
        except broker_errors(conn) as exc:
            # What arrived meanwhile goes back to the queue with the channel: handed
            # out after the reconnect, its ack would fail on the dead channel.
            raise self._translate("subscribing again", exc) from exc
        finally:
            self._received = None
        self._early.extend(received)
        self.release_acks()

    def stop_consuming(self) -> None:
        """Cancel the subscription; unacked (prefetched) messages go back on close."""
        with contextlib.suppress(BrokerUnavailable):
            self.release_acks()  # their messages are applied: acked, not handed back
        if self._consumer is not None and self.conn is not None:
            with contextlib.suppress(*broker_errors(self.conn)):
                self._consumer.cancel()
        self._consumer = None

    def close(self) -> None:
        self._consumer = None
        self._early = []
        self._tag, self._window, self._held_acks = None, [], None
        self._frames = None
        if self._heartbeats is not None:
            self._heartbeats.close()
            self._heartbeats = None
        if self.conn is not None:
            # Closing a dead connection must not hide the error that killed it.
            with contextlib.suppress(Exception):
                self.conn.release()
            self.conn = None


class _RawMessage(amqp.Message):  # type: ignore[misc]
    """A message sent with a property list given as bytes, through py-amqp's
    private ``_serialize_properties`` (no public way to send a list as it arrived;
    test_parked_retry.py's byte-for-byte retry pins it, in .ci/matrix too)."""

    def __init__(self, body: bytes, raw_properties: bytes) -> None:
        super().__init__(body)
        self._raw_properties = raw_properties

    def _serialize_properties(self) -> bytes:
        return self._raw_properties


class QueuePublisher:
    """Publishes straight to a queue (default exchange): persistent, ``mandatory``,
    and confirmed one by one, so a return (no such queue) or a nack raises
    ``NotTaken``.  Used by ``outbox parked retry``.  Every wait for the broker is
    bounded: the connection by ``connect_timeout``, opening the channel and
    selecting confirms by ``connect_timeout`` too, each publish, its write and its
    confirm, by ``confirm_timeout`` (``ConfirmTimedOut``; the connection is then of
    no more use), the closing handshake by ``confirm_timeout``."""

    def __init__(
        self, amqp_url: str, *, connect_timeout: float = 10.0, confirm_timeout: float = 30.0
    ) -> None:
        self.connect_timeout = connect_timeout
        self.confirm_timeout = confirm_timeout
        self._stalled = False  # a wait timed out: the broker may never answer
        self._returned: list[str] = []  # why the broker returned the last publish
        self.conn = Connection(amqp_url, connect_timeout=connect_timeout)
        try:
            self.conn.ensure_connection(
                max_retries=max(len(self.conn.alt), 1) - 1, interval_start=0
            )
            # py-amqp waits for channel.open-ok and confirm.select-ok with no timeout
            # of its own (for ever from a broker that stopped answering after the
            # handshake): both read under the socket's timeout.
            with self._bounded(self.conn.connection, connect_timeout):
                self.channel = self.conn.channel()
                self.channel.confirm_select()
                # py-amqp's private flag, else basic_publish_confirm selects confirms
                # again, waiting unbounded (pinned: test_library_internals.py).
                self.channel._confirm_selected = True
        except Exception as exc:
            self._stalled = True  # nothing to say goodbye to: the socket just goes
            self.close()
            if isinstance(exc, TimeoutError):
                raise BrokerUnavailable(
                    f"RabbitMQ stopped answering while opening a channel (nothing within "
                    f"{connect_timeout:g} s)",
                    "nothing was sent: every message stays parked; check the broker "
                    "(alarms, a stalled node or proxy), then retry again, or raise "
                    "--connect-timeout",
                ) from exc
            raise BrokerUnavailable(
                f"cannot connect to RabbitMQ: {exc!r}",
                "check --amqp-url / OUTBOX_AMQP_URL and that the broker is running",
            ) from exc
        self.channel.events["basic_return"].add(self._on_return)

    @staticmethod
    @contextlib.contextmanager
    def _bounded(connection: Any, seconds: float) -> Iterator[None]:
        """Each read and write of py-amqp's ``connection`` in the block waits at most
        ``seconds`` (those given a timeout of their own keep theirs)."""
        with connection.transport.having_timeout(seconds):
            yield

    def _on_return(self, exc: Any, exchange: Any, routing_key: Any, message: Any) -> None:
        self._returned.append(str(exc))

    def publish(
        self,
        queue: str,
        body: bytes,
        *,
        raw_properties: bytes | None,
        message_id: bytes,
        headers: dict[str, Any],
        properties: Mapping[str, Any],
    ) -> None:
        """Publish ``body`` to ``queue``.  With ``raw_properties`` (the property
        list as it arrived) exactly those properties are sent, persistent and with
        ``headers`` set in the header table; without (rows parked before raw
        properties were kept), ``message_id``, ``headers`` and the kept
        ``properties``."""
        message: amqp.Message
        if raw_properties is not None:
            message = _RawMessage(body, self._fitting(raw_properties, headers))
        else:
            kept = {k: v for k, v in properties.items() if k in KEPT_PROPERTIES}
            if isinstance(kept.get("timestamp"), str):
                kept["timestamp"] = datetime.datetime.fromisoformat(kept["timestamp"])
            message = amqp.Message(
                body,
                message_id=message_id.decode("utf-8", "surrogatepass"),
                delivery_mode=2,
                application_headers=headers,
                **kept,
            )
        size, limit = len(message._serialize_properties()), self._properties_limit()
        if size > limit:
            # The broker would close the connection on it (FRAME_ERROR), ending the run.
            raise NotTaken(
                f"its properties and headers take {size:,} bytes, more than one frame "
                f"holds ({limit:,} bytes under the broker's frame_max): it cannot be sent "
                "as it is",
                "purge it (`outbox parked purge ID`), or retry it against a broker that "
                "negotiates a larger frame_max",
            )
        self._returned.clear()
        try:
            # The return of an unroutable message comes before its confirm (an ack):
            # ``_on_return`` notes it, and the ack ends the wait.
            self.channel.basic_publish_confirm(
                message,
                exchange="",
                routing_key=queue,
                mandatory=True,
                timeout=self.confirm_timeout,  # the write
                confirm_timeout=self.confirm_timeout,
            )
        except MessageNacked as exc:
            raise NotTaken(
                f"RabbitMQ refused it (nack) for queue {queue!r}",
                "look at the broker's log and the queue's limits (x-overflow reject-publish)",
            ) from exc
        except (TimeoutError, amqp.RecoverableConnectionError) as exc:
            # py-amqp: a write that timed out is RecoverableConnectionError("... timed out").
            if not isinstance(exc, TimeoutError) and "timed out" not in str(exc):
                raise
            self._stalled = True
            raise ConfirmTimedOut(
                f"RabbitMQ did not confirm a message to queue {queue!r} within "
                f"{self.confirm_timeout:g} s",
                "whether it has the message is unknown: it stays listed; check the broker "
                "(alarms, a stalled connection), then retry again (the inbox skips a copy "
                "whose message was applied), or raise --publish-timeout",
            ) from exc
        if self._returned:
            raise NotTaken(
                f"RabbitMQ returned it as unroutable ({self._returned[0]}): no queue {queue!r}",
                "declare the queue again (or purge the message), then retry it",
            )

    def _properties_limit(self) -> int:
        """The longest property list one content header frame holds: a frame's
        payload is frame_max - 8 bytes, a content header's 12 + its properties."""
        return int(self.conn.connection.frame_max) - 8 - 12

    def _fitting(self, raw_properties: bytes, headers: dict[str, Any]) -> bytes:
        """``for_retry``'s property list if it fits in one frame (the broker closes
        the connection on a larger one, so the message could never be retried);
        else without ``headers`` (the handler then sees the default exchange and
        the queue as routing key), else exactly as it arrived (which ``publish``
        then refuses: ``NotTaken``)."""
        limit = self._properties_limit()
        for extra in (headers, {}):
            properties = wire.for_retry(raw_properties, extra)
            if len(properties) <= limit:
                return properties
        return raw_properties

    def close(self) -> None:
        if not self._stalled:
            try:
                # connection.close waits for close-ok: at most confirm_timeout.
                with self._bounded(self.channel.connection, self.confirm_timeout):
                    self.conn.release()
                return
            except Exception:
                self._stalled = True
        with contextlib.suppress(Exception):
            # No closing handshake (connection.close waits for close-ok, for ever
            # from a broker that stopped answering): the socket just goes.
            self.conn.collect(socket_timeout=self.confirm_timeout)
