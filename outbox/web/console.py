"""What the console reads and does, over the same modules as the CLI.

Every action calls the code its CLI command calls, so both keep one meaning:

- dead letters: ``DeadLetterStore.retry`` / ``purge`` (``outbox dead-letters retry`` /
  ``purge``): one statement each; a retried row keeps its id, so the rows of an
  ordering key go back in their original order, and a key's later rows stay held
  back behind a dead letter still there;
- parked messages: ``outbox.inbox.parked.retry`` and ``ParkedStore.purge`` (``outbox
  parked retry`` / ``purge``);
- in-doubt batches: ``resolver.run_pass`` (``outbox resolve [--dry-run]``).

Before an action the console shows what it would touch (``plan_*``: the same
selection, read without changing anything) and how many; the count acted on is the
one the statement returns.  Each session lives for one request: a console that is
left open holds no connection and no lock.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import datetime
import json
from collections.abc import Iterable, Sequence
from typing import Any

from outbox import gid as gids
from outbox.config import Settings
from outbox.errors import OutboxError
from outbox.inbox import parked as parked_ops
from outbox.inbox.store import ParkedStore
from outbox.ops import deadletters, status
from outbox.redaction import redact
from resolver import Resolution, run_pass

# The most rows a page lists, and the most a group action takes at once.
LIST_LIMIT = 1000
# The most bytes of a body a detail view reads and shows: its hex view is 4.3 times
# as long, and a message too large to publish (a dead letter) may hold 1 GB.
BODY_SHOWN = 64 * 1024


@dataclasses.dataclass(frozen=True)
class InboxTarget:
    """One inbox table in the consumer's database, and the bounds of its sessions
    and of a retry's publishes (``outbox web``'s options)."""

    dsn: str
    table: str
    statement_timeout: float = Settings.statement_timeout
    lock_timeout: float = Settings.lock_timeout
    publish_timeout: float = Settings.publish_timeout


@dataclasses.dataclass(frozen=True)
class ConsoleConfig:
    outboxes: tuple[Settings, ...]
    inboxes: tuple[InboxTarget, ...] = ()
    read_only: bool = False
    max_prepared_age: float = 60.0
    max_backlog_age: float = 300.0
    list_limit: int = LIST_LIMIT
    refresh_seconds: float = 5.0  # how often the overview reloads itself

    def outbox(self, table: str | None) -> Settings:
        """The settings of outbox ``table`` (the first one if None); KeyError if unknown."""
        if table is None:
            return self.outboxes[0]
        for settings in self.outboxes:
            if settings.table == table:
                return settings
        raise KeyError(table)

    def inbox(self, table: str | None) -> InboxTarget:
        if table is None and self.inboxes:
            return self.inboxes[0]
        for target in self.inboxes:
            if target.table == table:
                return target
        raise KeyError(table)


# -- reading ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Group:
    """Rows that share a value (a reason, an ordering key, a consumer and error)."""

    label: str
    count: int
    oldest: datetime.datetime | None
    ids: tuple[str, ...]  # what a selection of the whole group names


def group_rows(rows: Iterable[dict[str, Any]], key: str, at: str, ident: str) -> list[Group]:
    """Rows grouped by ``row[key]``, biggest group first (then oldest first)."""
    members: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows:
        value = row.get(key)
        if value is None:
            continue
        members[str(value)].append(row)
    groups = [
        Group(
            label=label,
            count=len(found),
            oldest=min((r[at] for r in found if r.get(at) is not None), default=None),
            ids=tuple(str(r[ident]) for r in found if r.get(ident) is not None),
        )
        for label, found in members.items()
    ]
    far_future = datetime.datetime.max.replace(tzinfo=datetime.timezone.utc)
    return sorted(groups, key=lambda g: (-g.count, g.oldest or far_future, g.label))


_FILTERED = (
    "id",
    "message_id",
    "reason",
    "error",
    "exchange",
    "routing_key",
    "ordering_key",
    "queue",
    "consumer",
)


def matches(row: dict[str, Any], text: str) -> bool:
    """The list filter: ``text`` in the row's ids, reason, destination or key."""
    needle = text.strip().lower()
    if not needle:
        return True
    return any(needle in str(row.get(f) or "").lower() for f in _FILTERED)


def overview(config: ConsoleConfig) -> dict[str, Any]:
    """Per outbox table: ``outbox status`` plus dead letters by reason; per inbox
    table: parked messages by consumer and error.  A section that cannot be read
    carries its error (redacted) instead of failing the whole page."""
    outboxes = []
    for settings in config.outboxes:
        section: dict[str, Any] = {"table": settings.table, "error": None}
        try:
            report = status.collect(
                settings,
                max_prepared_age=config.max_prepared_age,
                max_backlog_age=config.max_backlog_age,
            )
            alive = {r["relay_id"]: r["alive"] for r in report["relays"]}
            for batch in report["prepared_batches"]:
                parsed = gids.parse(batch["gid"])
                relay_id = parsed.relay_id if parsed else None
                batch["relay_id"] = relay_id
                batch["relay_alive"] = bool(relay_id and alive.get(relay_id))
            store = deadletters.open_store(settings)
            try:
                rows = store.entries(config.list_limit)
            finally:
                store.close()
            section["status"] = report
            section["dead_letter_reasons"] = group_rows(rows, "reason", "failed_at", "id")
        except OutboxError as exc:
            section["error"] = describe(exc)
        outboxes.append(section)
    inboxes = []
    for target in config.inboxes:
        inbox_section: dict[str, Any] = {"table": target.table, "error": None, "more": False}
        try:
            parked_rows = parked_entries(target, config.list_limit)
            inbox_section["parked"] = len(parked_rows)
            inbox_section["more"] = len(parked_rows) >= config.list_limit
            inbox_section["groups"] = parked_groups(parked_rows)
        except OutboxError as exc:
            inbox_section["error"] = describe(exc)
        inboxes.append(inbox_section)
    return {"outboxes": outboxes, "inboxes": inboxes}


def describe(exc: OutboxError) -> str:
    """An error as one line for a page (already redacted by ``OutboxError``)."""
    return redact(f"{exc.message} ({exc.hint})" if exc.hint else exc.message)


def dead_letter_list(settings: Settings, limit: int) -> list[dict[str, Any]]:
    store = deadletters.open_store(settings)
    try:
        return store.entries(limit)
    finally:
        store.close()


def dead_letter(settings: Settings, row_id: int) -> dict[str, Any] | None:
    store = deadletters.open_store(settings)
    try:
        return store.entry(row_id, BODY_SHOWN)
    finally:
        store.close()


def parked_store(target: InboxTarget) -> ParkedStore:
    return ParkedStore(
        target.dsn,
        target.table,
        statement_timeout=target.statement_timeout,
        lock_timeout=target.lock_timeout,
    )


def parked_entries(target: InboxTarget, limit: int) -> list[dict[str, Any]]:
    store = parked_store(target)
    try:
        return store.entries(limit)
    finally:
        store.close()


def parked_groups(rows: Sequence[dict[str, Any]]) -> list[Group]:
    """Parked messages by consumer and error (the selection is their message ids)."""
    labelled = [{**r, "group": f"{r['consumer']}: {r['error']}"} for r in rows]
    return group_rows(labelled, "group", "parked_at", "message_id")


def parked_message(target: InboxTarget, parked_id: int) -> dict[str, Any] | None:
    store = parked_store(target)
    try:
        return store.entry(parked_id, BODY_SHOWN)
    finally:
        store.close()


# -- a body as text, JSON or hex ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BodyViews:
    """The ways a payload (or its first ``shown`` bytes) can be shown."""

    size: int
    text: str | None  # if it is UTF-8 without control characters (but tab and newlines)
    json: str | None  # if it is JSON, indented (never for a part)
    hex: str  # always: offset, 16 bytes, printable characters (passwords masked)
    shown: int = 0  # bytes in these views: less than size for a long body


def body_views(body: bytes, size: int | None = None) -> BodyViews:
    """Views of ``body``, or of its first ``BODY_SHOWN`` bytes; ``size`` is the whole
    body's when ``body`` is already only its beginning."""
    size = len(body) if size is None else size
    body = body[:BODY_SHOWN]
    whole = len(body) == size
    text: str | None
    try:
        # A part may end inside a character: final=False leaves that one out.
        text = codecs.getincrementaldecoder("utf-8")().decode(body, final=whole)
    except UnicodeDecodeError:
        text = None
    if text is not None and any(ord(c) < 32 and c not in "\t\n\r" for c in text):
        text = None  # binary that happens to decode: hex says more
    pretty = None
    if text is not None and whole:
        try:
            pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=True)
        except ValueError:
            pretty = None
    lines = []
    masked = _masked(body)
    for offset in range(0, len(masked), 16):
        chunk = masked[offset : offset + 16]
        printable = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{offset:08x}  {chunk.hex(' '):<47}  {printable}")
    return BodyViews(size, text, pretty, "\n".join(lines), len(body))


def _masked(body: bytes) -> bytes:
    """``body`` with its passwords masked as the text views are (on the page, through
    ``redact``): a hex view shows every byte, so it must not show those."""
    # surrogateescape: every byte that is not UTF-8 comes back as it was.
    return redact(body.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


def pretty_json(text: str | None) -> str:
    """JSON text (as the stores return headers) indented; as it is if it is not JSON."""
    if text is None:
        return "-"
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False, sort_keys=True)
    except ValueError:
        return text


# -- selections and plans -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DeadLetterSelection:
    """What a dead-letter action names: row ids and/or ordering keys (the CLI's
    ``ID…`` and ``--ordering-key``).  A group by reason is named by its row ids."""

    row_ids: tuple[int, ...] = ()
    ordering_keys: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.row_ids or self.ordering_keys)

    @classmethod
    def parse(cls, ids: Sequence[str], keys: Sequence[str]) -> DeadLetterSelection:
        """From form or query values; ValueError names a value that is not a row id."""
        selection = deadletters.parse_ids([i for i in ids if i.strip()], keys)
        if selection.message_ids:
            raise ValueError("select dead letters by row id (a whole number)")
        return cls(tuple(sorted(set(selection.row_ids))), tuple(sorted(set(keys))))


def plan_dead_letters(settings: Settings, selection: DeadLetterSelection) -> list[dict[str, Any]]:
    """The dead letters a retry or purge of ``selection`` would touch, as of now."""
    store = deadletters.open_store(settings)
    try:
        return store.matching(row_ids=selection.row_ids, ordering_keys=selection.ordering_keys)
    finally:
        store.close()


def retry_dead_letters(settings: Settings, selection: DeadLetterSelection) -> list[dict[str, Any]]:
    """``outbox dead-letters retry ID… --ordering-key KEY…``: the rows moved back."""
    store = deadletters.open_store(settings)
    try:
        return store.retry(
            everything=False, row_ids=selection.row_ids, ordering_keys=selection.ordering_keys
        )
    finally:
        store.close()


def purge_dead_letters(settings: Settings, selection: DeadLetterSelection) -> list[dict[str, Any]]:
    """``outbox dead-letters purge ID… --ordering-key KEY…``: the rows deleted."""
    store = deadletters.open_store(settings)
    try:
        return store.purge(
            everything=False, row_ids=selection.row_ids, ordering_keys=selection.ordering_keys
        )
    finally:
        store.close()


def parked_selection(ids: Sequence[str]) -> tuple[str, ...]:
    """Parked messages are named by message id (as ``outbox parked retry ID…``)."""
    return tuple(sorted({i for i in ids if i.strip()}))


def plan_parked(target: InboxTarget, message_ids: Sequence[str]) -> list[dict[str, Any]]:
    store = parked_store(target)
    try:
        return store.matching(message_ids)
    finally:
        store.close()


def retry_parked(target: InboxTarget, amqp_url: str, message_ids: Sequence[str]) -> list[str]:
    """``outbox parked retry ID…``: the message ids sent back to their queues."""
    store = parked_store(target)
    try:
        return parked_ops.retry(
            store, amqp_url, list(message_ids), confirm_timeout=target.publish_timeout
        )
    finally:
        store.close()


def purge_parked(target: InboxTarget, message_ids: Sequence[str]) -> int:
    """``outbox parked purge ID…``: how many rows were deleted."""
    store = parked_store(target)
    try:
        return store.purge(list(message_ids), None)
    finally:
        store.close()


def resolve_pass(settings: Settings, *, dry_run: bool) -> list[Resolution]:
    """``outbox resolve [--dry-run]``: one resolver pass over the in-doubt batches."""
    return run_pass(settings, dry_run=dry_run, application_name="outbox-web")
