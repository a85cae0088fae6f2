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
import contextlib
import dataclasses
import datetime
import functools
import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from outbox import gid as gids
from outbox.config import Settings
from outbox.db.deadletters import DeadLetterStore
from outbox.db.inbox import ParkedStore
from outbox.errors import OutboxError
from outbox.inbox import parked as parked_ops
from outbox.ops import deadletters, status
from outbox.ops.quarantine import Row, Store, bounds_of, opened
from outbox.redaction import redact
from resolver import Resolution, run_pass

# The most rows a page lists, and the most a group action takes at once.
LIST_LIMIT = 1000
# The most bytes of a body a detail view reads and shows: its hex view is 4.3 times
# as long, and a message too large to publish (a dead letter) may hold 1 GB.
BODY_SHOWN = 64 * 1024
# How long an action waits for a row lock before it says who holds the rows: an
# in-doubt batch holds them until it is resolved, and a request waiting for it would
# hold one of the server's worker threads (40 such requests froze the console).
ACTION_LOCK_TIMEOUT = 2.0


def shown(value: Any) -> Any:
    """``value`` as a page may show it: every text in it (a reason, a key, an error,
    a host name) with its passwords masked (``redact``: the remembered ones and
    anything shaped like one), before it is escaped or put into a link.  Numbers
    and timestamps are left as they are: the page names rows by number only."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, uuid.UUID):
        return redact(str(value))
    if isinstance(value, dict):
        return {k: shown(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [shown(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class InboxTarget:
    """One inbox table in the consumer's database, and the bounds of its sessions
    and of a retry's publishes (``outbox web``'s options)."""

    dsn: str
    table: str
    connect_timeout: float = Settings.connect_timeout  # its sessions' and the broker's
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
    sample_seconds: float = 10.0  # how often the charts' sampler reads each table

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


def on_database(config: ConsoleConfig, dsn: str) -> ConsoleConfig:
    """``config`` with every outbox table in the database ``dsn`` reaches (a fleet's
    target), and no inbox: the consumers' database is not a target's."""
    return dataclasses.replace(
        config,
        outboxes=tuple(dataclasses.replace(s, dsn=dsn) for s in config.outboxes),
        inboxes=(),
    )


S = TypeVar("S", bound=Store)


# -- reading ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Group:
    """Rows that share a value (a reason, an ordering key, a consumer and error),
    named in links by one of its rows (``first_id``), never by its text."""

    label: str  # masked (``shown``)
    count: int
    oldest: datetime.datetime | None
    first_id: int


def _groups(rows: Iterable[dict[str, Any]]) -> list[Group]:
    return [
        Group(shown(str(r["label"])), int(r["count"]), r["oldest"], int(r["first_id"]))
        for r in rows
    ]


# How many groups a list or the overview shows.
GROUPS_SHOWN = 50


@dataclasses.dataclass(frozen=True)
class Listing:
    """One page of a list (rows masked for showing) and its groups."""

    rows: list[dict[str, Any]]
    total: int  # how many match, over the whole table
    offset: int
    groups: list[Group]
    key_groups: list[Group] = dataclasses.field(default_factory=list)


def overview(config: ConsoleConfig) -> dict[str, Any]:
    """Per outbox table: ``outbox status`` plus dead letters by reason; per inbox
    table: parked messages by consumer and error.  A section that cannot be read
    carries its error (redacted) instead of failing the whole page."""
    outboxes = []
    for settings in config.outboxes:
        section: dict[str, Any] = {"table": settings.table, "error": None}
        try:
            report = status_report(settings, config)
            with _dead_letters(settings) as store:
                reasons = _groups(store.groups("", "reason", GROUPS_SHOWN))
            section["status"] = shown(report)
            section["dead_letter_reasons"] = reasons
        except OutboxError as exc:
            section["error"] = describe(exc)
        outboxes.append(section)
    inboxes = []
    for target in config.inboxes:
        inbox_section: dict[str, Any] = {"table": target.table, "error": None}
        try:
            listing = parked_listing(target, "", 0, 1)
            inbox_section["parked"] = listing.total
            inbox_section["groups"] = listing.groups
        except OutboxError as exc:
            inbox_section["error"] = describe(exc)
        inboxes.append(inbox_section)
    return {"outboxes": outboxes, "inboxes": inboxes}


def status_report(settings: Settings, config: ConsoleConfig) -> dict[str, Any]:
    """``outbox status --json`` of one outbox table, each prepared batch with its
    relay's id and whether that relay is alive."""
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
    report["attention"] = [in_console(p, settings.table) for p in report["attention"]]
    return report


# The commands ``outbox status`` tells a shell user to run, and the console's page
# that does the same.
_CONSOLE_PAGES = (
    ("`outbox dead-letters", "/dead-letters", "Dead letters"),
    ("`outbox resolve", "/in-doubt", "In-doubt batches"),
)


def in_console(problem: str, table: str) -> dict[str, str]:
    """A problem ``outbox status`` found, with the console's page for it instead of
    the command a shell user would run (the advice after the last ``: `` before the
    command is left out): ``text``, ``link``, ``page``."""
    for command, path, page in _CONSOLE_PAGES:
        at = problem.find(command)
        if at >= 0:
            cut = problem.rfind(": ", 0, at)
            return {
                "text": problem[:cut] if cut > 0 else problem,
                "link": f"{path}?table={table}",
                "page": page,
            }
    return {"text": problem, "link": "", "page": ""}


def describe(exc: OutboxError) -> str:
    """An error as one line for a page (already redacted by ``OutboxError``)."""
    return redact(f"{exc.message} ({exc.hint})" if exc.hint else exc.message)


def _listing(
    store: S,
    text: str,
    offset: int,
    limit: int,
    groups: Callable[[S], tuple[list[Group], list[Group]]],
) -> Listing:
    """The page of a quarantine's entries matching ``text`` (over the whole table)
    that starts at ``offset``, and their ``groups`` (one or two groupings)."""
    rows = store.search(text, limit, offset)
    total = _total(rows, offset, lambda: store.search(text, 1, 0))
    return Listing(shown(rows), total, offset, *groups(store))


def _total(rows: Sequence[Row], offset: int, first: Callable[[], list[Row]]) -> int:
    """How many rows match: every row of a page carries it; a page past the end (or
    an empty result) asks again from the start."""
    if rows:
        return int(rows[0]["total"])
    again = first() if offset else []
    return int(again[0]["total"]) if again else 0


def _detail(store: Store, number: int, views: Callable[[Row], dict[str, Any]]) -> Row | None:
    """One entry, masked for showing, with its ``views`` (taken out of the row)."""
    row = store.entry(number, BODY_SHOWN)
    if row is None:
        return None
    taken = views(row)  # before the row is shown: they take its values out of it
    return {"row": shown(row), **taken}


def dead_letter_listing(settings: Settings, text: str, offset: int, limit: int) -> Listing:
    """The page of dead letters matching ``text`` that starts at ``offset``, and
    their groups by reason and by ordering key."""

    def groups(store: DeadLetterStore) -> tuple[list[Group], list[Group]]:
        reasons = _groups(store.groups(text, "reason", GROUPS_SHOWN))
        return reasons, _groups(store.groups(text, "key", GROUPS_SHOWN))

    with _dead_letters(settings) as store:
        return _listing(store, text, offset, limit, groups)


def dead_letter(settings: Settings, row_id: int) -> Row | None:
    """One dead letter, masked for showing, with ``body`` and ``headers`` views."""

    def views(row: Row) -> dict[str, Any]:
        return {
            "body": body_views(bytes(row.pop("payload")), row["payload_bytes"]),
            "headers": capped_json(row.pop("headers"), row.pop("headers_chars")),
        }

    with _dead_letters(settings) as store:
        return _detail(store, row_id, views)


# The most a download holds in memory: a larger value is left to psql.
DOWNLOAD_MOST = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Download:
    size: int
    value: bytes | None  # None: larger than DOWNLOAD_MOST; passwords masked


def whole_value(store: Store, number: int, what: str) -> Download | None:
    """The whole of one of an entry's values (``Kind.downloads``), for a download."""
    row = store.value(number, what, DOWNLOAD_MOST)
    if row is None or row["size"] is None:
        return None
    value = None if row["value"] is None else _masked(bytes(row["value"]))
    return Download(int(row["size"]), value)


def dead_letter_value(settings: Settings, row_id: int, what: str) -> Download | None:
    """The whole payload or headers of a dead letter, for a download."""
    with _dead_letters(settings) as store:
        return whole_value(store, row_id, what)


def _dead_letters(settings: Settings) -> contextlib.AbstractContextManager[DeadLetterStore]:
    return opened(functools.partial(deadletters.open_store, settings))


def _parked(target: InboxTarget) -> contextlib.AbstractContextManager[ParkedStore]:
    return opened(functools.partial(parked_store, target))


def parked_store(target: InboxTarget) -> ParkedStore:
    return ParkedStore(target.dsn, target.table, bounds_of(target))


def parked_listing(target: InboxTarget, text: str, offset: int, limit: int) -> Listing:
    """The page of parked messages matching ``text`` that starts at ``offset``, and
    their groups by consumer and error."""

    def groups(store: ParkedStore) -> tuple[list[Group], list[Group]]:
        found = store.groups(text, GROUPS_SHOWN)
        return _groups({**g, "label": f"{g['consumer']}: {g['error']}"} for g in found), []

    with _parked(target) as store:
        return _listing(store, text, offset, limit, groups)


def parked_message(target: InboxTarget, parked_id: int) -> Row | None:
    """One parked message, masked for showing, with its views."""

    def views(row: Row) -> dict[str, Any]:
        return {
            "body": body_views(bytes(row.pop("body")), row["body_bytes"]),
            "headers": capped_json(row.pop("headers"), row.pop("headers_chars")),
            "properties": capped_json(row.pop("properties"), row.pop("properties_chars")),
        }

    with _parked(target) as store:
        return _detail(store, parked_id, views)


def parked_value(target: InboxTarget, parked_id: int, what: str) -> Download | None:
    """The whole body, headers or properties of a parked message, for a download."""
    with _parked(target) as store:
        return whole_value(store, parked_id, what)


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
    return BodyViews(
        size,
        None if text is None else redact(text),
        None if pretty is None else redact(pretty),
        "\n".join(lines),
        len(body),
    )


def _masked(body: bytes) -> bytes:
    """``body`` with its passwords masked as the text views are (on the page, through
    ``redact``): a hex view shows every byte, so it must not show those."""
    # surrogateescape: every byte that is not UTF-8 comes back as it was.
    return redact(body.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


@dataclasses.dataclass(frozen=True)
class Capped:
    """A JSON text (headers, properties) as shown: at most its first ``BODY_SHOWN``
    characters (indented when whole), passwords masked; ``size`` is the whole's."""

    text: str
    size: int
    whole: bool


def capped_json(text: str | None, size: int | None) -> Capped:
    if text is None:
        return Capped("-", 0, True)
    whole = size is None or size <= len(text)
    return Capped(redact(pretty_json(text) if whole else text), size or len(text), whole)


def pretty_json(text: str) -> str:
    """JSON text (as the stores return headers) indented; as it is if it is not JSON."""
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


_MAX_ROW_ID = 2**63 - 1  # bigint


def row_numbers(values: Sequence[str], what: str) -> tuple[int, ...]:
    """Row numbers from a form or a query (blank values skipped); ValueError, with a
    one-line reason, for anything that is not one."""
    numbers = set()
    for value in values:
        text = value.strip()
        if not text:
            continue
        if not (text.isascii() and text.isdigit() and len(text) <= 19):
            raise ValueError(f"{what} is a row number (a whole number), not {_quoted(text)}")
        if int(text) > _MAX_ROW_ID:
            raise ValueError(f"{what} is a row number: {text} is past the last one ({_MAX_ROW_ID})")
        numbers.add(int(text))
    return tuple(sorted(numbers))


def _quoted(text: str, most: int = 40) -> str:
    """Text a client sent, for a one-line error: short, escaped, passwords masked."""
    short = text if len(text) <= most else text[: most - 1] + "…"
    return redact(repr(short))


def select_dead_letters(
    settings: Settings,
    row_ids: Sequence[int],
    *,
    reason_of: int | None = None,
    key_of: Sequence[int] = (),
    limit: int,
) -> DeadLetterSelection:
    """What a link or a form names, by row numbers only (never by a text a page would
    have to carry): these rows, the oldest ``limit`` with row ``reason_of``'s reason,
    and every dead letter with the ordering key of a row of ``key_of``."""
    chosen = set(row_ids)
    with _dead_letters(settings) as store:
        if reason_of is not None:
            chosen.update(store.sharing_reason(reason_of, limit))
        keys = store.keys_of(key_of) if key_of else []
    return DeadLetterSelection(tuple(sorted(chosen)), tuple(keys))


def plan_dead_letters(settings: Settings, selection: DeadLetterSelection) -> list[dict[str, Any]]:
    """The dead letters a retry or purge of ``selection`` would touch, as of now."""
    with _dead_letters(settings) as store:
        return store.matching(row_ids=selection.row_ids, ordering_keys=selection.ordering_keys)


def retry_dead_letters(settings: Settings, selection: DeadLetterSelection) -> list[Row]:
    """``outbox dead-letters retry ID… --ordering-key KEY…``: the rows moved back."""
    return _act_on_dead_letters(settings, selection, DeadLetterStore.retry)


def purge_dead_letters(settings: Settings, selection: DeadLetterSelection) -> list[Row]:
    """``outbox dead-letters purge ID… --ordering-key KEY…``: the rows deleted."""
    return _act_on_dead_letters(settings, selection, DeadLetterStore.purge)


def _act_on_dead_letters(
    settings: Settings,
    selection: DeadLetterSelection,
    action: Callable[..., list[Row]],
) -> list[Row]:
    # Not waiting for an in-doubt batch's rows (``ACTION_LOCK_TIMEOUT``): the request
    # says who holds them instead.
    with _dead_letters(settings) as store:
        return action(
            store,
            everything=False,
            row_ids=selection.row_ids,
            ordering_keys=selection.ordering_keys,
            lock_timeout=ACTION_LOCK_TIMEOUT,
        )


def select_parked(
    target: InboxTarget, parked_ids: Sequence[int], *, group_of: int | None = None, limit: int
) -> tuple[str, ...]:
    """The message ids an action takes (``outbox parked retry ID…``), from what a
    link or form names by number: these parked rows, and the oldest ``limit`` of
    row ``group_of``'s group (its consumer and error)."""
    if not parked_ids and group_of is None:
        return ()
    with _parked(target) as store:
        return tuple(store.message_ids(parked_ids, group_of, limit))


def plan_parked(target: InboxTarget, message_ids: Sequence[str]) -> list[Row]:
    with _parked(target) as store:
        return store.matching(message_ids)


def retry_parked(
    target: InboxTarget, amqp_url: str, message_ids: Sequence[str]
) -> tuple[list[str], list[parked_ops.NotSent]]:
    """``outbox parked retry ID…``: the message ids sent back to their queues, and
    those the broker did not take (still parked), with why."""
    not_sent: list[parked_ops.NotSent] = []
    with _parked(target) as store:
        retried = parked_ops.retry(
            store,
            amqp_url,
            list(message_ids),
            connect_timeout=target.connect_timeout,
            confirm_timeout=target.publish_timeout,
            not_sent=not_sent,
        )
    return retried, not_sent


def purge_parked(target: InboxTarget, message_ids: Sequence[str]) -> int:
    """``outbox parked purge ID…``: how many rows were deleted."""
    with _parked(target) as store:
        return store.purge(list(message_ids), None)


def resolve_pass(settings: Settings, *, dry_run: bool) -> list[Resolution]:
    """``outbox resolve [--dry-run]``: one resolver pass over the in-doubt batches."""
    return run_pass(settings, dry_run=dry_run, application_name="outbox-web")
