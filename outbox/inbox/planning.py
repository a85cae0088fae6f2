"""The consumer's pure decisions: how a message is applied (``plan``), what became
of it (``Disposition``), why it is parked (
``unfinished_reason``, ``outcome_reason``, ``unusable``), how long a failed one
waits in hand for its next attempt (``retry_delay``; ``row_held_delay`` for one whose
inbox row is held) and how long it may be held
at most (``Held``, ``MAX_HOLD``), and when the consumer subscribes again
(``room_to_subscribe``, ``cancel_returns_deliveries``).  No I/O: ``steps`` and
``process`` act on them."""

from __future__ import annotations

import dataclasses
import enum
import random
from typing import Any

from outbox import backoff
from outbox.amqp.message import InboxMessage
from outbox.amqp.policy import QueuePolicy
from outbox.inbox.settings import ConsumerSettings


class Disposition(enum.Enum):
    HANDLED = "handled"  # effect committed: ack
    DUPLICATE = "duplicate"  # id already in the inbox: ack, no effect
    RETRY = "retry"  # handler failed: kept unacked, applied again after a delay
    # Its inbox row is held by another transaction: kept unacked, no attempt counted,
    # applied again after ``row_held_delay``.
    HELD = "held"
    PARKED = "parked"  # given up (or no message id): ack, row in <inbox>_parked
    BEHIND = "behind"  # not applied: an earlier message of its ordering key waits to retry


class Plan(enum.Enum):
    BATCH = "batch"  # a first delivery: with the others, one transaction, nothing before
    ALONE = "alone"  # redelivered: its attempt is committed first, then it is applied alone
    PARK = "park"  # redelivered, its earlier attempts reached --max-attempts: parked unseen


def plan(redelivered: bool, attempts: int, max_attempts: int) -> Plan:
    """How a message is applied (pure).  ``attempts``: the committed count of its
    earlier attempts, failed or unfinished (read only for a redelivered message,
    or one from custody: a first delivery never costs a read)."""
    if not redelivered:
        return Plan.BATCH
    if attempts >= max_attempts:
        return Plan.PARK
    return Plan.ALONE


def unfinished_reason(attempts: int, last_error: str) -> str:
    """Why a message parked by ``Plan.PARK`` is parked: its last attempt was counted
    and no outcome of it was ever recorded.  The handler may have killed the process,
    or the consumer died or lost its database before it could record the outcome
    (an error the handler raised included): which one, nothing here can tell."""
    why = (
        "the consumer died or lost its database before recording it: the handler may "
        "kill the process (a segfault, the OOM killer, os._exit)"
    )
    if not last_error:
        return f"redelivered {attempts} times, the outcome of the last attempt unknown ({why})"
    return (
        f"{attempts} attempts failed or did not finish, the outcome of the last one "
        f"unknown ({why}); the last error recorded: {last_error}"
    )


def retry_delay(
    attempts: int, settings: ConsumerSettings, rng: random.Random | None = None
) -> float:
    """Seconds a failed message waits in hand for its next attempt (pure, capped)."""
    return backoff.delay(
        max(0, attempts - 1),
        initial=settings.retry_delay,
        maximum=settings.retry_delay_max,
        rng=rng,
    )


# The longest a message whose inbox row is held waits between two tries (seconds).
ROW_HELD_DELAY_MAX = 5.0


def row_held_delay(held_for: float, settings: ConsumerSettings) -> float:
    """Seconds a message whose inbox row another transaction holds waits in hand
    before it is tried again (pure), ``held_for`` seconds after it was first found
    held: as long again, from ``--retry-delay`` up to ``ROW_HELD_DELAY_MAX``.  Each
    try costs the consumer's thread up to ``store.RECORD_LOCK_TIMEOUT``: a few
    percent of its time while the row stays held.  Not ``--retry-delay-max``: no
    handler failed, and a short maximum there would make the tries take most of it."""
    return min(ROW_HELD_DELAY_MAX, max(settings.retry_delay, held_for))


Dispositions = list[tuple[Disposition, float]]


def unusable(message: InboxMessage) -> str | None:
    """Why ``message`` cannot go to the handler at all (it is parked at once)."""
    if message.unreadable is not None:
        return f"its AMQP properties cannot be read: {message.unreadable}"
    if message.message_id is None:
        return "no message_id: cannot be deduplicated"
    return None


# A failed message is kept in hand (unacked) for at most this long: RabbitMQ closes
# the channel of a delivery unacked for ``consumer_timeout`` (30 min by default).
MAX_HOLD = 15 * 60.0


@dataclasses.dataclass(frozen=True)
class Held:
    delivery: Any
    due: float  # monotonic time of its next attempt
    since: float  # when it first failed in this delivery


def outcome_reason(held: Held, now: float) -> str:
    return (
        f"still failing after {now - held.since:.0f} s in the consumer's hands; its next "
        f"attempt would come after {MAX_HOLD:.0f} s, near RabbitMQ's consumer_timeout"
    )


def room_to_subscribe(in_hand: int, mine: int, prefetch: int, hand_most: int) -> bool:
    """Whether to subscribe again (``Inbox._make_room``): the ``in_hand`` messages
    held or waiting behind their key, ``mine`` of them from the current
    subscription, take half of its ``prefetch`` slots, and ``hand_most`` x
    ``prefetch`` bounds what may then be unacked: those in hand from earlier
    subscriptions, the current one's whole window (those still on their way count
    too) and the new one's."""
    if mine < max(1, prefetch // 2):
        return False
    return in_hand - mine + 2 * prefetch <= hand_most * prefetch


def cancel_returns_deliveries(policy: QueuePolicy) -> bool:
    """Whether cancelling a subscription hands back to the queue what was on its
    way to it.  A quorum queue does: the broker's side of the channel forgets the
    tag when basic.cancel goes out, and returns every delivery that reaches it
    for the tag after that (RabbitMQ's ``rabbit_fifo_client``), each a delivery
    counted against ``x-delivery-limit`` and handed out again, possibly after
    later messages of its ordering key.  Nothing is on its way to a subscription
    whose whole ``--prefetch`` window is in hand, unacked (the queue sends a
    consumer no more than that): there a cancel returns nothing
    (``Broker.window_in_hand``)."""
    return policy.queue_type == "quorum"
