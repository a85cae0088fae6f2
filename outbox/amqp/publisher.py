"""The relay's I/O with RabbitMQ (pika): the only product module that drives a pika
connection (the bench's bare publisher does too, as the baseline it measures).

``Publisher`` wraps a pika ``SelectConnection`` whose I/O loop is driven from the
relay's own thread: ``publish`` writes a whole batch without waiting, then runs the
loop until every message is confirmed, returned, nacked or in doubt, or until the
timeout.  That pipelines publisher confirms (one round trip per batch, not per
message), which is what makes a confirmed publisher fast.

Why ``mandatory``: without it the broker confirms a message that no queue took and
drops it, so a confirm alone would be false evidence.  With it, an unroutable
message comes back as ``basic.return`` *before* its confirm, and is reported as
``Outcome.RETURNED``.  Why confirms: a message is only the broker's
responsibility once confirmed (for persistent messages on durable queues, after
the write); before that it is in doubt.

A channel closed by the broker (404 missing exchange, 406 message too large)
leaves every unconfirmed message in doubt (``Outcome.UNKNOWN``); the next batch
opens a fresh channel.

The pure parts live elsewhere: the frames' bytes in ``outbox.amqp.frames``, which
message a confirm or a return is about in ``outbox.amqp.confirms``.  pika's private
members that the fast paths need (writing our own frames, reading confirm frames
ourselves, telling an idle socket from a pass of the I/O loop) are used only
through ``_Wire`` below, and ``tests/unit/amqp/test_pika_private.py`` pins them.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import select
import ssl
import struct
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection
from pika.adapters.utils import connection_workflow
from pika.adapters.utils.io_services_utils import _AsyncPlaintextTransport

from outbox import urls
from outbox.amqp import failover
from outbox.amqp.confirms import Confirms, Delivery, Outcome, Pending
from outbox.amqp.frames import (
    FLUSH_BYTES,
    Confirm,
    FrameTooLarge,
    Message,
    Piece,
    coalesce,
    encode_publish,
    leading_confirms,
)
from outbox.errors import BrokerUnavailable, InvalidSetting, OutboxError
from outbox.events import emit

log = logging.getLogger("outbox.publisher")


class _Wire:
    """pika's private members that the publisher's fast paths need, in one place.

    pika sends a message as three frame objects, one ``send()`` each; we hand it
    whole runs of frames we encoded ourselves (``outbox.amqp.frames``).  That takes the
    largest body frame the connection negotiated (``_body_max_length``) and the
    call at the end of pika's own send path (``_output_marshaled_frames``).
    ``tests/unit/amqp/test_pika_private.py`` pins both, so a pika upgrade that changes
    them fails the suite instead of the relay; .ci/matrix runs it and
    ``tests/integration/amqp/test_pika_wire.py`` on the oldest and newest pika allowed.
    pika has no public equivalent of any member used here: its public calls
    (``basic_publish``, a pass of the I/O loop) are the slower paths these replace.
    """

    @staticmethod
    def body_max(conn: SelectConnection) -> int:
        return int(conn._body_max_length)

    @staticmethod
    def write(conn: SelectConnection, pieces: list[Piece]) -> None:
        # pika queues each piece as it is (a view too) until the socket takes it.
        conn._output_marshaled_frames(pieces)

    @staticmethod
    def flush(conn: SelectConnection) -> bool:
        """Write what pika holds for the socket, as much as it takes now, as a pass of
        the I/O loop would when the socket is writable, without setting a poller up
        and tearing it down.  False for a TLS connection: its writes go through the
        SSL object's state machine, and only a pass of the loop drives that."""
        transport = conn._transport
        if type(transport) is not _AsyncPlaintextTransport:
            return False
        if transport.get_write_buffer_size():
            transport._on_socket_writable()  # stops watching for writable once all is out
        return True

    @staticmethod
    def quiet(conn: SelectConnection) -> bool:
        """Nothing to read on the connection's socket and nothing buffered to write:
        a pass of the I/O loop would do nothing (one ``select`` instead of a pass,
        which sets a poller up and tears it down)."""
        transport = conn._transport
        if transport is None or transport.get_write_buffer_size():
            return False
        sock = transport._sock
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return False  # decrypted bytes waiting that select cannot see
        readable, _, _ = select.select([sock], [], [], 0)
        return not readable

    @staticmethod
    def take_confirms(
        conn: SelectConnection,
        channel: Callable[[], int | None],
        on_confirms: Callable[[list[Confirm]], None],
    ) -> None:
        """Decode the confirm frames that start each read from the socket ourselves
        (``frames.leading_confirms``) and hand them to ``on_confirms``; pika gets
        the rest of the read, and every read while it holds part of a frame
        (``_frame_buffer``).  ``channel``: the confirm-mode channel's number now,
        None while there is none (then pika dispatches every frame, as before).

        What pika does for each frame it reads is done here too: count its bytes
        (``bytes_received``, which pika's heartbeat checker watches) and the frame
        (``frames_received``)."""
        receive = conn._on_data_available

        def on_data_available(data: bytes) -> None:
            number = channel()
            if number is not None and not conn._frame_buffer:
                used, confirms = leading_confirms(data, number)
                if used:
                    conn.bytes_received += used
                    conn.frames_received += len(confirms)
                    on_confirms(confirms)
                    if used == len(data):
                        return
                    data = data[used:]
            receive(data)

        conn._on_data_available = on_data_available


def connection_parameters(
    url: str, *, ca_file: str | None = None, connect_timeout: float = 10.0
) -> list[tuple[pika.URLParameters, str]]:
    """pika's parameters for every URL of ``url`` (a ``;`` list of a cluster's
    nodes), in order, each with where it points (no password).

    An ``amqps://`` URL is verified against the system's CAs (pika's default
    context: certificate and host name), or against ``ca_file``.  The publisher
    and the ledger reader both connect through here.
    """
    try:
        nodes = urls.parse_amqp_urls(url)
        params = [pika.URLParameters(node.text) for node in nodes]
    except (ValueError, TypeError, SyntaxError) as exc:
        raise InvalidSetting(
            f"the RabbitMQ URL is not valid: {exc}", "check --amqp-url / OUTBOX_AMQP_URL"
        ) from None
    for node, node_params in zip(nodes, params, strict=True):
        node_params.socket_timeout = connect_timeout
        node_params.connection_attempts = 1
        if ca_file is not None and node.scheme == "amqps":
            try:
                context = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise InvalidSetting(
                    f"cannot load CA certificates from {ca_file!r}: {exc.strerror or exc}",
                    "--amqp-ca-file / OUTBOX_AMQP_CA_FILE must name a readable PEM file",
                ) from exc
            node_params.ssl_options = pika.SSLOptions(context)  # checks the URL's host name
    return [(p, node.describe()) for p, node in zip(params, nodes, strict=True)]


class Publisher:
    """A confirm-mode channel on one connection, driven synchronously."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 10.0,
        blocked_timeout: float = 60.0,
        ca_file: str | None = None,
    ) -> None:
        # The nodes of one cluster (``outbox.amqp.failover``), each with where it points.
        self._nodes = connection_parameters(url, ca_file=ca_file, connect_timeout=connect_timeout)
        for params, _address in self._nodes:
            # Tear the connection down if an alarm blocks it for this long.
            params.blocked_connection_timeout = blocked_timeout
        self._node: int | None = None  # the node of the current (or last) connection
        self._connect_timeout = connect_timeout
        self._conn: SelectConnection | None = None
        self._channel: Any = None
        self._opened = False
        self._failure: str | None = None
        self._channel_closed: str | None = None
        # Several batches may be in flight on the channel, in delivery-tag order.
        self._confirms = Confirms()
        self._done: Callable[[], bool] | None = None
        self.blocked = False

    # -- the I/O loop, driven from this thread ---------------------------------
    def _run_until(self, done: Callable[[], bool], timeout: float) -> bool:
        if done():
            return True
        conn = self._conn
        if conn is None:
            return False
        self._done = done
        timer = conn.ioloop.call_later(max(timeout, 0.0), conn.ioloop.stop)
        try:
            conn.ioloop.start()
        finally:
            conn.ioloop.remove_timeout(timer)
            self._done = None
        return done()

    def _poke(self) -> None:
        if self._done is not None and self._done() and self._conn is not None:
            self._conn.ioloop.stop()

    # -- connection ------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return (
            self._conn is not None and self._opened and self._conn.is_open and self._failure is None
        )

    @property
    def nodes(self) -> int:
        """How many nodes ``--amqp-url`` names."""
        return len(self._nodes)

    @property
    def servers(self) -> list[tuple[str, int]]:
        """Every node's (host, port), for knocking while it is down (``relay.recovery``)."""
        return [(str(params.host), int(params.port)) for params, _address in self._nodes]

    @property
    def address(self) -> str:
        """Where the current (or last) connection points, without credentials."""
        return self._nodes[self._node or 0][1]

    def connect(self) -> None:
        """Open a connection to the first node that answers (``failover.rotation``)
        and a confirm-mode channel on it, or raise BrokerUnavailable."""
        self.close()
        failures = []
        for node in failover.rotation(len(self._nodes), after=self._node):
            params, address = self._nodes[node]
            reason = self._open(params)
            if reason is None:
                self._node = node
                break
            failures.append(f"{address}: {reason}")
            emit(log, "broker.node_unreachable", logging.DEBUG, node=address, reason=reason)
        else:
            if len(self._nodes) == 1:
                message = f"cannot connect to RabbitMQ at {failures[0]}"
            else:
                message = f"cannot connect to any RabbitMQ node: {'; '.join(failures)}"
            raise BrokerUnavailable(message, _connect_hint(message))
        assert self._conn is not None
        self._conn.add_on_connection_blocked_callback(lambda *_: self._set_blocked(True))
        self._conn.add_on_connection_unblocked_callback(lambda *_: self._set_blocked(False))
        self._open_channel()

    def _open(self, params: pika.URLParameters) -> str | None:
        """Open a connection to one node; None, or why it failed."""
        self._opened = False
        self._failure = None
        # A new connection starts unblocked: the broker says connection.blocked again
        # if an alarm still holds when it publishes.  Left set by a connection that
        # pika's blocked_connection_timeout closed, no connection.unblocked would ever
        # clear it, and the relay would claim nothing until restarted.
        self.blocked = False
        self._conn = SelectConnection(
            params,
            on_open_callback=self._on_open,
            on_open_error_callback=self._on_open_error,
            on_close_callback=self._on_connection_closed,
        )
        _Wire.take_confirms(self._conn, self._confirm_channel, self._on_confirms)
        self._run_until(lambda: self._opened or self._failure is not None, self._connect_timeout)
        if self._opened:
            return None
        reason = self._failure or "timed out"
        self.close()
        return reason

    def _set_blocked(self, blocked: bool) -> None:
        self.blocked = blocked
        log.warning("broker.blocked" if blocked else "broker.unblocked")

    def _on_open(self, _conn: Any) -> None:
        self._opened = True
        self._poke()

    def _on_open_error(self, _conn: Any, error: BaseException | str) -> None:
        self._failure = _describe(error)
        self._poke()

    def _on_connection_closed(self, _conn: Any, reason: BaseException) -> None:
        self._failure = _describe(reason)
        self._channel_closed = self._failure
        self._channel = None
        self._poke()

    def _open_channel(self) -> None:
        assert self._conn is not None
        state: dict[str, Any] = {}

        def opened(channel: Any) -> None:
            state["channel"] = channel
            channel.add_on_close_callback(self._on_channel_closed)
            channel.add_on_return_callback(self._on_return)
            channel.confirm_delivery(
                ack_nack_callback=self._on_confirm,
                callback=lambda _frame: self._confirming(state),
            )

        self._channel_closed = None
        self._conn.channel(on_open_callback=opened)
        ok = self._run_until(
            lambda: "confirming" in state or self._failure is not None, self._connect_timeout
        )
        if not ok or self._failure is not None:
            raise BrokerUnavailable(
                f"cannot open a RabbitMQ channel: {self._failure or 'timed out'}"
            )
        self._channel = state["channel"]
        self._confirms.new_channel("channel replaced before its confirms arrived")

    def _confirming(self, state: dict[str, Any]) -> None:
        state["confirming"] = True
        self._poke()

    def _on_channel_closed(self, channel: Any, reason: BaseException) -> None:
        if channel is not self._channel and self._channel is not None:
            return
        self._channel = None
        self._channel_closed = _describe(reason)
        self._confirms.give_up(f"channel closed: {self._channel_closed}")
        self._poke()

    def close(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
        if conn is None:
            return
        try:
            if conn.is_open:
                conn.close()
                self._conn = conn
                self._run_until(lambda: conn.is_closed, 2.0)
        except Exception:
            log.debug("broker.close_failed", exc_info=True)
        finally:
            self._conn = None

    @property
    def frame_max(self) -> int | None:
        """The largest frame the broker accepts on this connection (negotiated at
        connection.tune; pika keeps it in the connection's public ``params``)."""
        if self._conn is None or not self._opened:
            return None
        return int(self._conn.params.frame_max)

    # -- publishing ------------------------------------------------------------
    def publish(self, messages: Sequence[Message], timeout: float) -> list[Delivery]:
        """Publish persistently with ``mandatory`` and wait for every confirm.

        Returns one ``Delivery`` per message, in order.  Raises BrokerUnavailable if
        not connected at the start; a connection lost midway leaves the unconfirmed
        deliveries ``UNKNOWN``.
        """
        return self.confirmed(self.send(messages), timeout)

    def send(self, messages: Sequence[Message]) -> Pending:
        """Write every message (persistent, ``mandatory``) without waiting for confirms.

        Confirms are collected whenever the I/O loop runs: by ``confirmed``, and while
        later batches are sent.  Several sends may be outstanding on the channel.
        """
        if not self.connected:
            raise BrokerUnavailable("not connected to RabbitMQ")
        if self._channel is None:
            self._open_channel()
        channel = self._channel
        conn = self._conn
        assert conn is not None
        pending = Pending([Delivery() for _ in messages])
        number, body_max = channel.channel_number, _Wire.body_max(conn)
        frame_max = self.frame_max
        chunk: list[Piece] = []
        chunk_indexes: list[int] = []
        size = 0
        for index, message in enumerate(messages):
            try:
                data = encode_publish(
                    number, message, mandatory=True, body_max=body_max, frame_max=frame_max
                )
            except FrameTooLarge as exc:
                pending.deliveries[index].outcome = Outcome.REJECTED
                pending.deliveries[index].reason = str(exc)
                continue
            except (
                pika.exceptions.AMQPError,
                ValueError,
                TypeError,
                OverflowError,
                RecursionError,
                struct.error,
            ) as exc:
                # A value AMQP cannot carry (nothing was sent): this message can never
                # be published, the others go on.
                pending.deliveries[index].outcome = Outcome.REJECTED
                pending.deliveries[index].reason = f"cannot be encoded as AMQP: {_describe(exc)}"
                continue
            chunk += data
            chunk_indexes.append(index)
            size += len(data[0]) if len(data) == 1 else sum(map(len, data))
            if size >= FLUSH_BYTES:
                if not self._write(channel, pending, chunk, chunk_indexes, messages):
                    break
                chunk, chunk_indexes, size = [], [], 0
                # Let the broker start on what we sent; take the confirms so far.
                self._run_until(lambda: False, 0.0)
        else:
            if chunk:
                self._write(channel, pending, chunk, chunk_indexes, messages)
        # Start the transfer now: the broker works while the caller does other things.
        if not _Wire.flush(conn):
            self._run_until(lambda: False, 0.0)
        return pending

    def confirmed(self, pending: Pending, timeout: float) -> list[Delivery]:
        """Wait until every message of ``pending`` is confirmed, returned, nacked or lost.

        A timeout abandons the channel: every message still unconfirmed on it, of
        this batch or another, is then in doubt (late confirms must not be taken
        for a later batch's).  A nack abandons it too (below), but only once the
        confirms due for the other messages on it have come (or ``timeout``): a
        batch published beside a nacked one is finished by its own confirms.
        """
        self._run_until(lambda: pending.settled or self._failure is not None, timeout)
        if not pending.settled:
            if self._failure is not None:
                self._confirms.give_up(f"connection lost: {self._failure}")
            else:
                self._confirms.give_up("no confirm before the publish timeout")
                self._abandon_channel("channel abandoned after a confirm timeout")
        elif pending.nacked:
            # RabbitMQ 3.10: a channel whose publish to a quorum queue was nacked
            # because the queue's leader had just died nacks every later publish to
            # that queue, long after a new leader took over; a new channel does not.
            # What else is out on it (the next batch, published beside this one)
            # is confirmed or nacked first, not put in doubt.
            self._run_until(lambda: not self._confirms or self._failure is not None, timeout)
            self._abandon_channel("channel abandoned after a nack")
        for delivery in pending.deliveries:
            if delivery.outcome is Outcome.UNKNOWN and not delivery.reason:
                delivery.reason = "not sent: the channel closed"
        return pending.deliveries

    def collect_confirms(self) -> None:
        """Take the confirms that have arrived so far, without waiting."""
        if self.connected and not _Wire.quiet(self._conn):
            self._run_until(lambda: False, 0.0)

    def wait_for_confirms(self, timeout: float) -> bool:
        """Serve the connection until nothing sent is unconfirmed (or ``timeout``)."""
        return self._run_until(lambda: not self._confirms or self._failure is not None, timeout)

    def _write(
        self,
        channel: Any,
        pending: Pending,
        chunk: list[Piece],
        indexes: list[int],
        messages: Sequence[Message],
    ) -> bool:
        """Hand encoded messages to the transport; False if the channel is gone."""
        conn = self._conn
        if channel is not self._channel or not channel.is_open or conn is None or conn.is_closed:
            reason = f"channel closed: {self._channel_closed or self._failure or 'unknown'}"
            for index in indexes:
                pending.deliveries[index].reason = reason
            return False
        self._confirms.track(pending, indexes, messages)
        _Wire.write(conn, coalesce(chunk))
        return True

    def _abandon_channel(self, reason: str) -> None:
        channel, self._channel = self._channel, None
        self._confirms.give_up(reason)
        if channel is not None and channel.is_open:
            try:
                channel.close()
            except Exception:
                log.debug("broker.channel_close_failed", exc_info=True)

    def _confirm_channel(self) -> int | None:
        channel = self._channel
        return None if channel is None else int(channel.channel_number)

    def _on_confirms(self, confirms: list[Confirm]) -> None:
        """Confirms decoded by ``_Wire.take_confirms`` (pika's dispatch bypassed)."""
        confirm = self._confirms.confirm
        for delivery_tag, multiple, accepted in confirms:
            confirm(delivery_tag, multiple=multiple, accepted=accepted)
        self._poke()

    def _on_confirm(self, frame: Any) -> None:
        """A confirm pika dispatched (one not at the head of a read)."""
        if frame.channel_number != self._confirm_channel():
            # A channel abandoned after a confirm timeout, still closing: its messages
            # are in doubt already, and its tags are not the new channel's.
            return
        method = frame.method
        accepted = isinstance(method, pika.spec.Basic.Ack)
        self._on_confirms([Confirm(method.delivery_tag, method.multiple, accepted)])

    def _on_return(self, _channel: Any, method: Any, properties: Any, body: bytes) -> None:
        self._confirms.returned(
            method.exchange,
            method.routing_key,
            properties.message_id,
            body,
            f"{method.reply_code} {method.reply_text}",
        )

    # -- topology --------------------------------------------------------------
    def exchange_exists(self, name: str) -> bool:
        """Passive declare on a throwaway channel (a 404 closes only that channel)."""
        return self._passive(lambda ch, cb: ch.exchange_declare(name, passive=True, callback=cb))

    def _passive(self, declare: Callable[[Any, Callable[[Any], None]], None]) -> bool:
        state = self._on_throwaway_channel(declare)
        if "ok" in state:
            return True
        closed = state.get("closed")
        if isinstance(closed, pika.exceptions.ChannelClosedByBroker) and closed.reply_code == 404:
            return False
        raise BrokerUnavailable(f"could not check the broker's topology: {_describe(closed)}")

    def _on_throwaway_channel(
        self, declare: Callable[[Any, Callable[[Any], None]], None]
    ) -> dict[str, Any]:
        """Run one declare on a channel of its own; a broker error closes only that one.

        Returns ``{"ok": True}`` on success or ``{"closed": reason}``.
        """
        if not self.connected or self._conn is None:
            raise BrokerUnavailable("not connected to RabbitMQ")
        state: dict[str, Any] = {}

        def closed(_channel: Any, reason: BaseException) -> None:
            state["closed"] = reason
            self._poke()

        def declared(_frame: Any) -> None:
            state["ok"] = True
            self._poke()

        def opened(channel: Any) -> None:
            state["channel"] = channel
            channel.add_on_close_callback(closed)
            declare(channel, declared)

        self._conn.channel(on_open_callback=opened)
        finished = self._run_until(
            lambda: "ok" in state or "closed" in state or self._failure is not None,
            self._connect_timeout,
        )
        if "ok" in state and state["channel"].is_open:
            state["channel"].close()
        if not finished or self._failure is not None:
            raise BrokerUnavailable(
                f"RabbitMQ did not answer a declare: {self._failure or 'timed out'}"
            )
        return state

    def declare_stream(self, name: str, max_age: str) -> None:
        """Declare the durable stream queue the ledger lives in (idempotent)."""
        state = self._on_throwaway_channel(
            lambda ch, cb: ch.queue_declare(
                name,
                durable=True,
                arguments={"x-queue-type": "stream", "x-max-age": max_age},
                callback=cb,
            )
        )
        closed = state.get("closed")
        if "ok" not in state and not (
            isinstance(closed, pika.exceptions.ChannelClosedByBroker) and closed.reply_code == 406
        ):
            # A broker still starting up (stream coordinator not ready) is transient.
            raise BrokerUnavailable(
                f"cannot declare the ledger stream {name!r}: {_describe(closed)}"
            )
        if "ok" not in state:
            raise OutboxError(
                f"cannot declare the ledger stream {name!r}: {_describe(state.get('closed'))}",
                "a queue of that name exists with other arguments: delete it or set "
                "--ledger-queue to another name",
            )

    # -- idle ------------------------------------------------------------------
    def wait(self, timeout: float, wake_fd: int | Sequence[int] | None = None) -> bool:
        """Serve the connection (heartbeats) for up to ``timeout`` seconds.

        Returns True early when ``wake_fd`` (or one of several) becomes readable (a
        NOTIFY arrived on the PostgreSQL control session, a stop flag was set).
        """
        if self._conn is None or not self.connected:
            return False
        woken: list[bool] = []
        ioloop = self._conn.ioloop
        fds = [] if wake_fd is None else [wake_fd] if isinstance(wake_fd, int) else list(wake_fd)

        def on_readable(_fd: int, _events: int) -> None:
            woken.append(True)
            ioloop.stop()

        for fd in fds:
            ioloop.add_handler(fd, on_readable, ioloop.READ)
        try:
            self._run_until(lambda: bool(woken) or self._failure is not None, timeout)
        finally:
            for fd in fds:
                ioloop.remove_handler(fd)
        return bool(woken)


def _connect_hint(reason: str) -> str:
    if "CERTIFICATE" in reason or "certificate" in reason:
        return (
            "the broker's certificate must be signed by the CA in --amqp-ca-file / "
            "OUTBOX_AMQP_CA_FILE (default: the system's CAs) and name the URL's host"
        )
    return "check --amqp-url / OUTBOX_AMQP_URL and that the broker is running"


def _describe(error: object) -> str:
    if isinstance(
        error, pika.exceptions.ChannelClosedByBroker | pika.exceptions.ConnectionClosedByBroker
    ):
        return f"{error.reply_code} {error.reply_text}"
    # pika wraps the socket error (refused, timed out, no route) two levels deep.
    if isinstance(error, pika.exceptions.AMQPConnectionError) and error.args:
        error = error.args[0]
    if isinstance(error, connection_workflow.AMQPConnectionWorkflowFailed) and error.exceptions:
        error = error.exceptions[-1]
    if isinstance(error, connection_workflow.AMQPConnectorException) and getattr(
        error, "exception", None
    ):
        error = error.exception
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error) or type(error).__name__
    return text.splitlines()[0]


def read_stream(
    url: str,
    queue: str,
    *,
    since: datetime.datetime | None,
    probe: bytes,
    timeout: float,
    connect_timeout: float = 10.0,
    ca_file: str | None = None,
) -> Iterator[bytes]:
    """Yield the bodies of a stream queue from ``since`` (or its start) up to ``probe``.

    AMQP gives a stream reader no end-of-stream signal, so we first append a probe
    record (confirmed), then read until we meet it again: everything written
    before the probe has then been seen.
    """
    # One node: ``ledger.finished_gids`` moves on to the next when this one fails.
    [(params, address), *_others] = connection_parameters(
        url, ca_file=ca_file, connect_timeout=connect_timeout
    )
    try:
        conn = pika.BlockingConnection(params)
    except pika.exceptions.AMQPError as exc:
        reason = _describe(exc)
        raise BrokerUnavailable(
            f"cannot connect to RabbitMQ at {address} to read the ledger: {reason}",
            _connect_hint(reason),
        ) from exc
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        channel.basic_publish(
            "",
            queue,
            probe,
            pika.BasicProperties(delivery_mode=2, message_id=str(uuid.uuid4())),
            mandatory=True,
        )
        channel.basic_qos(prefetch_count=1000)
        offset: Any = since.astimezone(datetime.timezone.utc) if since else "first"
        for seen, (method, _props, body) in enumerate(
            channel.consume(
                queue, arguments={"x-stream-offset": offset}, inactivity_timeout=timeout
            ),
            start=1,
        ):
            if method is None:
                raise BrokerUnavailable(
                    f"reading the ledger {queue!r} stalled for {timeout}s "
                    "before the probe came back"
                )
            if seen % 500 == 0:
                channel.basic_ack(method.delivery_tag, multiple=True)
            if body == probe:
                break
            yield body
        # No channel.cancel(): it rejects the records already buffered after the probe
        # (another reader's probe, a relay's new record), and a stream queue answers a
        # reject by closing the channel (540).  Closing the connection drops them.
    except pika.exceptions.UnroutableError as exc:
        if _queue_exists(conn, queue):
            # A stream whose replicas are down or still electing a leader returns
            # what is published to it: transient, unlike a missing stream.
            raise BrokerUnavailable(
                f"the ledger stream {queue!r} takes no records at {address} right now"
            ) from exc
        raise OutboxError(
            f"the ledger stream {queue!r} does not exist",
            "start a relay once (it declares the stream) or check --ledger-queue",
        ) from exc
    except pika.exceptions.AMQPError as exc:
        raise BrokerUnavailable(
            f"lost RabbitMQ at {address} while reading the ledger: {_describe(exc)}"
        ) from exc
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError):
            conn.close()


def _queue_exists(conn: pika.BlockingConnection, queue: str) -> bool:
    """Passive declare on a channel of its own: False only for "404 no queue".

    A queue whose home node is down is a 404 too, but "home node … is down or
    inaccessible": it exists.
    """
    try:
        conn.channel().queue_declare(queue, passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        return not (exc.reply_code == 404 and "no queue" in str(exc.reply_text))
    except pika.exceptions.AMQPError:
        pass  # the connection went too: whether it exists is for the next try
    return True
