"""Which message a confirm or a return is about: the publisher's bookkeeping (pure).

Every message written to the confirm-mode channel gets the next delivery tag and
waits in ``Confirms`` until its ``basic.ack``/``basic.nack`` arrives (one frame may
settle many tags with ``multiple``), or until the channel or connection is lost
(then it is in doubt: ``Outcome.UNKNOWN``).

Bookkeeping never keys on ``message_id``: rows may share one.  A confirm names
its delivery tag; a ``basic.return`` names no tag, but the broker returns
unroutable messages in publish order, each before its own ack, so a return
belongs to the first unconfirmed message after the previous return whose
exchange, routing key, message id and body it carries (``match_return``).

Why ``mandatory`` needs confirms: without ``mandatory`` the broker confirms a
message that no queue took and drops it, so a confirm alone would be false
evidence.  With it, an unroutable message comes back as ``basic.return`` *before*
its confirm and is reported as ``Outcome.RETURNED``.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from outbox.amqp.frames import Message


class Outcome(enum.Enum):
    ACCEPTED = "accepted"  # confirmed (ack) and routed
    RETURNED = "returned"  # unroutable: basic.return before the ack
    NACKED = "nacked"  # the broker could not take it (transient)
    REJECTED = "rejected"  # pika cannot encode it (e.g. a header value): never publishable
    UNKNOWN = "unknown"  # no confirm: channel or connection lost, or timed out


@dataclasses.dataclass
class Delivery:
    outcome: Outcome = Outcome.UNKNOWN
    reason: str = ""
    # Written to the socket: an UNKNOWN outcome then means "maybe on the broker",
    # which a rollback turns into a possible duplicate.
    sent: bool = False


@dataclasses.dataclass(eq=False)
class Pending:
    """Messages handed to the broker by ``send`` whose confirms may still be due."""

    deliveries: list[Delivery]
    outstanding: int = 0  # sent and neither confirmed nor given up
    nacked: int = 0  # deliveries the broker nacked

    @property
    def settled(self) -> bool:
        return self.outstanding == 0


class Unconfirmed(NamedTuple):
    """One message on the channel, by delivery tag, until its confirm arrives (a
    tuple: one is made per message on the hot path)."""

    pending: Pending
    delivery: Delivery
    message: Message


def match_return(
    unconfirmed: Mapping[int, Unconfirmed],
    after_tag: int,
    exchange: str,
    routing_key: str,
    message_id: str | None,
    body: bytes,
) -> int | None:
    """The delivery tag a ``basic.return`` belongs to, or None.

    The broker handles a channel's publishes in order and returns an unroutable
    one at once, before its ack, so returns arrive in publish order: the message
    is the first unconfirmed one after the previously returned tag that carries
    the same exchange, routing key, message id and body.  Rows sharing a
    ``message_id`` are told apart by position, never merged.  Only two messages
    identical in all four, one routed and one not (a binding changed between two
    publishes), could be swapped, and their contents are the same.
    """
    for tag, entry in unconfirmed.items():
        if tag <= after_tag:
            continue
        message = entry.message
        if (
            entry.delivery.outcome is Outcome.UNKNOWN
            and not entry.delivery.reason
            and message.exchange == exchange
            and message.routing_key == routing_key
            and message.message_id == message_id
            and message.body == body
        ):
            return tag
    return None


class Confirms:
    """The unconfirmed messages of one channel, by delivery tag (in publish order)."""

    def __init__(self) -> None:
        self._unconfirmed: collections.OrderedDict[int, Unconfirmed] = collections.OrderedDict()
        self._next_tag = 1
        self._last_returned_tag = 0

    def __bool__(self) -> bool:
        return bool(self._unconfirmed)

    def __len__(self) -> int:
        return len(self._unconfirmed)

    def new_channel(self, reason: str) -> None:
        """A fresh channel numbers from 1 again; what the old one had is in doubt."""
        self.give_up(reason)
        self._next_tag = 1
        self._last_returned_tag = 0

    def track(self, pending: Pending, indexes: Iterable[int], messages: Sequence[Message]) -> None:
        """Messages ``indexes`` of ``pending`` were written, in this order."""
        count = 0
        for index in indexes:
            delivery = pending.deliveries[index]
            delivery.sent = True
            self._unconfirmed[self._next_tag] = Unconfirmed(pending, delivery, messages[index])
            self._next_tag += 1
            count += 1
        pending.outstanding += count

    def confirm(self, delivery_tag: int, *, multiple: bool, accepted: bool) -> None:
        """A ``basic.ack`` (``accepted``) or ``basic.nack`` arrived."""
        if multiple:
            tags = []
            for tag in self._unconfirmed:
                if tag > delivery_tag:
                    break
                tags.append(tag)
        else:
            tags = [delivery_tag] if delivery_tag in self._unconfirmed else []
        for tag in tags:
            entry = self._unconfirmed.pop(tag)
            pending, delivery = entry.pending, entry.delivery
            pending.outstanding -= 1
            if not accepted:
                pending.nacked += 1
                delivery.outcome = Outcome.NACKED
                delivery.reason = "nacked by the broker"
            elif delivery.outcome is not Outcome.RETURNED:
                delivery.outcome = Outcome.ACCEPTED

    def returned(
        self,
        exchange: str,
        routing_key: str,
        message_id: str | None,
        body: bytes,
        reply: str,
    ) -> None:
        """A ``basic.return`` arrived: mark its message RETURNED (its ack follows)."""
        tag = match_return(
            self._unconfirmed, self._last_returned_tag, exchange, routing_key, message_id, body
        )
        if tag is None:
            return  # a late return for a message already given up: it stays in doubt
        self._last_returned_tag = tag
        delivery = self._unconfirmed[tag].delivery
        delivery.outcome = Outcome.RETURNED
        delivery.reason = (
            f"unroutable: exchange {exchange!r} has no queue bound for "
            f"routing key {routing_key!r} ({reply})"
        )

    def give_up(self, reason: str) -> None:
        """Every unconfirmed message is in doubt from now on (``Outcome.UNKNOWN``)."""
        for entry in self._unconfirmed.values():
            if not entry.delivery.reason:
                entry.delivery.reason = reason
            entry.pending.outstanding -= 1
        self._unconfirmed.clear()
