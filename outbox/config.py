"""One frozen settings object, built from CLI flags and ``OUTBOX_*`` variables.

Every field has a CLI option of the same name (``batch_size`` → ``--batch-size``)
that also reads ``OUTBOX_<NAME>`` (``OUTBOX_BATCH_SIZE``); ``outbox relay --help``
lists them.  The defaults are the values the README documents.
"""

from __future__ import annotations

import dataclasses
import re

_TABLE_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")

DEFAULT_DSN = "postgresql://localhost/postgres"
DEFAULT_AMQP_URL = "amqp://guest:guest@localhost:5672/%2F"


@dataclasses.dataclass(frozen=True)
class Settings:
    dsn: str = DEFAULT_DSN
    amqp_url: str = DEFAULT_AMQP_URL
    # The outbox table; its companions are <table>_relays and <table>_dead_letters.
    table: str = "outbox"
    # Stream queue that records every fully accepted batch (the resolver's evidence).
    ledger_queue: str = "outbox.ledger"
    # Retention of the ledger stream (RabbitMQ x-max-age syntax).
    ledger_max_age: str = "7D"
    # Most rows claimed, prepared and published as one batch.
    batch_size: int = 1000
    # Most payload bytes in one batch (a larger row goes alone): bounds the relay's
    # memory, which holds at most two batches (pipelined) and their encoded frames.
    batch_max_bytes: int = 16 * 1024 * 1024
    # Claim and PREPARE the next batch while the broker confirms the current one
    # (two batches in flight): more throughput; a crash can leave two batches to
    # resolve and at most 2 x batch_size duplicates (``--no-pipeline``: one, and
    # batch_size).  The fault suite runs in both modes.
    pipeline: bool = True
    # How long a batch may wait for publisher confirms before it is rolled back.
    publish_timeout: float = 30.0
    # Fallback poll when no NOTIFY arrives (seconds); wake-ups normally come from commits.
    poll_interval: float = 5.0
    # Heartbeat of the relay's registry row (seconds).
    heartbeat_interval: float = 5.0
    # A relay whose heartbeat is older than this is presumed partitioned: the
    # resolver may finish its batches and the relay no longer commits them itself.
    relay_timeout: float = 60.0
    # How often a relay resolves batches left by dead relays (seconds).
    resolve_interval: float = 30.0
    # How far before a batch's PREPARE the resolver starts reading the ledger, to
    # absorb clock skew between the PostgreSQL and RabbitMQ hosts (seconds).
    ledger_clock_skew: float = 300.0
    # Largest message the broker accepts (RabbitMQ max_message_size, 128 MiB default).
    max_message_bytes: int = 128 * 1024 * 1024
    # Reconnect backoff bounds (seconds).
    backoff_initial: float = 0.2
    backoff_max: float = 30.0
    # Seconds to wait for a TCP connection to either server.
    connect_timeout: float = 10.0
    # Bound on every statement the relay runs (PostgreSQL statement_timeout and
    # lock_timeout); a statement cancelled by it is logged and retried.
    statement_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not _TABLE_NAME.match(self.table):
            raise ValueError(
                f"table name {self.table!r} is not valid: use lower-case letters, digits "
                "and underscores, at most 41 characters, not starting with a digit"
            )
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.batch_max_bytes < 1:
            raise ValueError("batch_max_bytes must be at least 1")
        if self.statement_timeout <= 0:
            raise ValueError("statement_timeout must be more than 0 seconds")
        if self.relay_timeout <= 2 * self.heartbeat_interval:
            raise ValueError("relay_timeout must be more than twice heartbeat_interval")
