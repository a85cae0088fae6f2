"""One frozen settings object, built from CLI flags and ``OUTBOX_*`` variables.

Every field has a CLI option of the same name (``batch_size`` → ``--batch-size``)
that also reads ``OUTBOX_<NAME>`` (``OUTBOX_BATCH_SIZE``); ``outbox relay --help``
lists them.  The defaults are the values docs/reference/configuration.md documents.

``LIMITS`` is the range of every number; the CLI's option types are built from it
(``cli.py``) and ``Settings`` checks it again, so the Python API refuses what the
command line refuses.  Every bound keeps the relay out of a failure mode: a poll
interval of 0 is a busy loop, a publish timeout of 0 never commits, a
``max_message_bytes`` below 1 dead-letters everything, and seconds beyond a day
overflow the timers of the I/O loop.
"""

from __future__ import annotations

import dataclasses
import math
import re

from outbox import redaction, urls
from outbox.tables import TABLE_NAME

# RabbitMQ's x-max-age: a positive whole number and one unit (years, months, days,
# hours, minutes, seconds), e.g. 7D or 12h.
LEDGER_MAX_AGE = re.compile(r"^[1-9][0-9]{0,8}[YMDhms]$")

DAY = 86400.0


@dataclasses.dataclass(frozen=True)
class Limit:
    """An inclusive range, or exclusive at the bottom when ``above`` is set."""

    low: float
    high: float
    above: bool = False  # the value must be greater than ``low``, not equal to it

    def admits(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return (value > self.low if self.above else value >= self.low) and value <= self.high

    def describe(self) -> str:
        return f"{'above' if self.above else 'at least'} {_number(self.low)} and at most " + (
            _number(self.high)
        )


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


LIMITS: dict[str, Limit] = {
    "batch_size": Limit(1, 100_000),
    "batch_max_bytes": Limit(1, 2**40),
    "publish_timeout": Limit(0, 3600, above=True),
    "poll_interval": Limit(0.05, DAY),
    "heartbeat_interval": Limit(0.05, DAY),
    "relay_timeout": Limit(0, 7 * DAY, above=True),
    "resolve_interval": Limit(0.05, DAY),
    "rescan_interval": Limit(1, DAY),
    "ledger_clock_skew": Limit(0, DAY),
    "max_message_bytes": Limit(1, 512 * 1024 * 1024),  # RabbitMQ's own ceiling
    "backoff_initial": Limit(0.01, 3600),
    "backoff_max": Limit(0.01, DAY),
    "connect_timeout": Limit(0, 3600, above=True),
    "statement_timeout": Limit(0, DAY, above=True),
    "lock_timeout": Limit(0, DAY, above=True),
    "dormant_after": Limit(0, DAY),
}

ORDERING_DEAD_LETTERS = ("block", "skip")

DEFAULT_DSN = "postgresql://localhost/postgres"
DEFAULT_AMQP_URL = "amqp://guest:guest@localhost:5672/%2F"


@dataclasses.dataclass(frozen=True)
class Settings:
    dsn: str = DEFAULT_DSN
    amqp_url: str = DEFAULT_AMQP_URL
    # The outbox table; its companions are <table>_relays, <table>_dead_letters,
    # <table>_schema_version and <table>_claim_front (outbox/tables.py).
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
    # How often a pass of the safety net begins (seconds), counted from the last pass
    # any relay began: it finds rows behind the claim front whose txid is not their
    # writer's (``outbox.db.front``); such a row waits at most 1.5 times this.
    rescan_interval: float = 600.0
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
    # Bound on each wait for a lock in an operator's sessions (``outbox status``,
    # ``resolve``, ``init``, ``dead-letters``, ``parked``, the console), which also
    # have ``statement_timeout``: a row held by an in-doubt batch makes a statement
    # wait for the batch's resolution, forever without it (the relay's own sessions
    # bound their lock waits by ``statement_timeout``).
    lock_timeout: float = 5.0
    # CA certificate(s) (PEM) that amqps:// brokers must be signed by; None: the
    # system's trusted CAs.  (PostgreSQL takes sslrootcert= in the DSN.)
    amqp_ca_file: str | None = None
    # What a dead letter does to the later messages of its ordering key: "block"
    # (they follow it into the dead letters until it is retried or purged: no gap)
    # or "skip" (they go on; a retried dead letter arrives after them).
    ordering_dead_letters: str = "block"
    # Seconds with nothing to claim after which the relay goes dormant: it keeps only
    # its wake-up session (one PostgreSQL session) until a commit, a poll, a due
    # scheduled row or an orphaned prepared batch wakes it (``outbox.relay.process``).
    # 0: never (one database); a fleet (``outbox relay --targets``) defaults to 30.
    dormant_after: float = 0.0

    @property
    def hold_keys(self) -> bool:
        """Dead letters hold their ordering key's later rows back."""
        return self.ordering_dead_letters == "block"

    def __repr__(self) -> str:
        def shown(value: object) -> str:
            # Mask before repr(): repr escapes quotes and backslashes, and a masked
            # password must be found as it is.
            return repr(redaction.redact(value) if isinstance(value, str) else value)

        fields = ", ".join(
            f"{f.name}={shown(getattr(self, f.name))}" for f in dataclasses.fields(self)
        )
        return f"Settings({fields})"

    def __post_init__(self) -> None:
        # First of all: whatever is wrong below, no message may show these passwords.
        redaction.remember(self.dsn, self.amqp_url)
        if not TABLE_NAME.match(self.table):
            raise ValueError(
                f"table name {self.table!r} is not valid: use lower-case letters, digits "
                "and underscores, at most 41 characters, not starting with a digit"
            )
        for name, limit in LIMITS.items():
            if not limit.admits(getattr(self, name)):
                raise ValueError(f"{name} must be {limit.describe()}")
        if self.relay_timeout <= 2 * self.heartbeat_interval:
            raise ValueError("relay_timeout must be more than twice heartbeat_interval")
        if self.backoff_max < self.backoff_initial:
            raise ValueError("backoff_max must be at least backoff_initial")
        if not LEDGER_MAX_AGE.match(self.ledger_max_age):
            raise ValueError(
                "ledger_max_age must be a whole number and a unit of Y, M, D, h, m or s "
                "(RabbitMQ's x-max-age), e.g. 7D"
            )
        if self.ordering_dead_letters not in ORDERING_DEAD_LETTERS:
            raise ValueError(
                f"ordering_dead_letters must be one of {', '.join(ORDERING_DEAD_LETTERS)}"
            )
        problem = queue_name_problem(self.ledger_queue)
        if problem:
            raise ValueError(f"ledger_queue {problem}")
        try:
            urls.check_dsn(self.dsn)
        except urls.InvalidUrl as exc:
            redaction.remember(self.dsn, refused=True)
            raise ValueError(f"dsn: {exc}") from None
        try:
            brokers = urls.parse_amqp_urls(self.amqp_url)
        except urls.InvalidUrl as exc:
            redaction.remember(self.amqp_url, refused=True)
            raise ValueError(f"amqp_url: {exc}") from None
        if self.amqp_ca_file is not None:
            if not any(b.scheme == "amqps" for b in brokers):
                raise ValueError("amqp_ca_file is set but amqp_url is not amqps://: TLS is off")
            if any("ssl_options" in dict(b.params) for b in brokers):
                raise ValueError(
                    "amqp_url has ssl_options and amqp_ca_file is set: give the CA in one place"
                )


def queue_name_problem(name: str, *, declared: bool = True) -> str | None:
    """Why RabbitMQ would refuse ``name`` as a queue name, or None.  Only a queue we
    declare may not start with ``amq.`` (``declared=False``: one we only consume)."""
    if not name.strip():
        return "is empty"
    if len(name.encode()) > 255:
        return "is longer than 255 bytes"
    if declared and name.startswith("amq."):
        return "starts with 'amq.', which RabbitMQ reserves for itself"
    return None
