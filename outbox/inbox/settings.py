"""What ``outbox consume`` is told: its settings (each a CLI option and an
``OUTBOX_*`` variable) and the ``--bind`` pairs.  Plain data, read by the consumer
(``outbox.inbox.process``, ``outbox.inbox.steps``) and the broker
(``outbox.amqp.consumer``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from outbox.config import DEFAULT_AMQP_URL, DEFAULT_DSN, queue_name_problem
from outbox.db.inbox import DEFAULT_INBOX_TABLE
from outbox.tables import TABLE_NAME

# basic.qos carries the prefetch count in 16 bits.
MAX_PREFETCH = 65535
# A failed message waits for its next attempt in the consumer's hands (``Inbox``),
# unacked; RabbitMQ closes the channel of a delivery unacked for ``consumer_timeout``
# (30 min by default).  One delay stays well below that.
MAX_RETRY_DELAY = 600.0
# Ids younger than this are never pruned: the relay's duplicates arrive within seconds
# of the original, and a shorter window would apply them again.
MIN_INBOX_RETENTION = 60.0


@dataclasses.dataclass(frozen=True)
class ConsumerSettings:
    """Everything ``outbox consume`` takes; each field is a CLI option and OUTBOX_* variable."""

    queue: str
    dsn: str = DEFAULT_DSN
    amqp_url: str = DEFAULT_AMQP_URL
    inbox_table: str = DEFAULT_INBOX_TABLE
    # Who the ids are recorded for (default: the queue).  Consumers of several
    # queues that form one logical consumer (consistent-hash shards) share one name.
    consumer_name: str | None = None
    # Unacked messages at once; a batch takes at most half (``batch_size``), so the
    # next batch is already on the connection while one commits.
    prefetch: int = 200
    max_attempts: int = 5
    retry_delay: float = 0.1
    retry_delay_max: float = 5.0
    inbox_retention: float = 7 * 86400.0
    prune_interval: float = 60.0
    # (exchange, binding key) pairs: declare the queue and bind it at start-up.
    bindings: tuple[tuple[str, str], ...] = ()
    backoff_initial: float = 0.2
    backoff_max: float = 30.0
    connect_timeout: float = 10.0
    heartbeat: int = 60
    # The queue's delivery limit when a policy sets it (the consumer reads the
    # ``x-delivery-limit`` argument itself, not policies: ``broker.read_policy``).
    delivery_limit: int | None = None

    def __post_init__(self) -> None:
        if not self.queue:
            raise ValueError("give the queue to consume (--queue / OUTBOX_QUEUE)")
        if not TABLE_NAME.match(self.inbox_table):
            raise ValueError(
                f"inbox table name {self.inbox_table!r} is not valid: use lower-case letters, "
                "digits and underscores, at most 41 characters, not starting with a digit"
            )
        if not 1 <= self.prefetch <= MAX_PREFETCH:
            raise ValueError(f"prefetch must be from 1 to {MAX_PREFETCH} (basic.qos is 16 bits)")
        for name, value in (("queue", self.queue), ("consumer_name", self.consumer_name)):
            problem = queue_name_problem(value, declared=False) if value is not None else None
            if problem:
                raise ValueError(f"{name}: the name {problem}")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if not self.inbox_retention >= MIN_INBOX_RETENTION:
            raise ValueError(
                f"inbox retention must be at least {MIN_INBOX_RETENTION:g} s (1m): a shorter "
                "window applies the relay's duplicates again"
            )
        if not 0 <= self.retry_delay <= self.retry_delay_max <= MAX_RETRY_DELAY:
            raise ValueError(
                "retry delays must be 0 <= --retry-delay <= --retry-delay-max <= "
                f"{MAX_RETRY_DELAY:g} s (a failed message waits unacked, below RabbitMQ's "
                f"consumer_timeout); got {self.retry_delay:g} and {self.retry_delay_max:g}"
            )
        if self.backoff_max < self.backoff_initial:
            raise ValueError(
                f"--backoff-max ({self.backoff_max:g}) must be at least --backoff-initial "
                f"({self.backoff_initial:g})"
            )
        if self.delivery_limit is not None and self.delivery_limit < 0:
            raise ValueError("delivery_limit must be 0 or more")

    @property
    def consumer(self) -> str:
        return self.consumer_name or self.queue

    @property
    def batch_size(self) -> int:
        """The most messages one transaction takes: half the prefetch (at least 1),
        so the broker refills the other half while a batch commits instead of after
        its ack."""
        return max(1, self.prefetch // 2)


def parse_bindings(texts: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """``EXCHANGE:BINDING_KEY`` pairs (the key may contain ':'; '#' if omitted)."""
    pairs = []
    for text in texts:
        exchange, _, key = text.partition(":")
        if not exchange:
            raise ValueError(f"{text!r} is not EXCHANGE:BINDING_KEY (e.g. orders:order.*)")
        pairs.append((exchange, key or "#"))
    return tuple(pairs)
