"""The console's pages of the one quarantine (``outbox.ops.quarantine``): dead letters
of an outbox table and parked messages of an inbox table.

Both have the same five routes under their path: the list (filtered and paged; htmx
asks for the listing alone), one entry, the download of one of its values, the
confirmation of a retry or purge (a GET that shows what it would touch and how
many), and the action (a POST from that page, CSRF-checked and audited).  What
differs is said by each ``Pages`` subclass: how a table is named in a link, how
rows are selected, and what a retry does.
"""

from __future__ import annotations

import abc
import dataclasses
import urllib.parse
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from outbox.config import Settings
from outbox.ops.deadletters import DEAD_LETTERS
from outbox.ops.parked import PARKED
from outbox.ops.quarantine import Kind, Row
from outbox.web import console
from outbox.web.console import InboxTarget
from outbox.web.site import (
    Site,
    action_of,
    audit,
    audited_database,
    client_of,
    download,
    expected_count,
    one_row_number,
    page_offset,
    plural,
    search_text,
    where_dsn,
)

# How many rows of each ordering key a confirmation posts back to name the key.
KEY_ROWS_POSTED = 10

W = TypeVar("W", Settings, InboxTarget)


@dataclasses.dataclass(frozen=True)
class Reads(Generic[W]):
    """How the console reads one quarantine (``console``): a page of the list, one
    entry with its views, one of its values whole."""

    listing: Callable[[W, str, int, int], console.Listing]
    entry: Callable[[W, int], Row | None]
    value: Callable[[W, int, str], console.Download | None]


@dataclasses.dataclass(frozen=True)
class Done:
    """What an action did: how many, the rows to list, those the broker did not
    take (a retry of parked messages), and the audit entry's own fields."""

    count: int
    rows: list[Row]
    not_taken: list[Row]
    audited: dict[str, Any]


class Pages(abc.ABC, Generic[W]):
    """One quarantine's routes over ``path``; ``W`` is where its table is (an outbox's
    settings, an inbox target), named in links and forms by ``field``."""

    kind: Kind
    field: str  # the query or form field that names the table: "table"
    entry_template: str  # one entry's page ("{kind.name}.html" is the list's)
    reads: Reads[W]
    missing: str  # the 404's text for an entry that is not there ({number}, {table})
    files: str  # how a download's file name starts: "dead-letter"

    @property
    def path(self) -> str:
        return f"/{self.kind.command}"

    def __init__(self, site: Site) -> None:
        self.site = site

    def routes(self) -> list[Route]:
        entry = self.path + "/{number:outbox_digits}"
        return [
            Route(self.path, self.listing),
            Route(f"{self.path}/confirm", self.confirm),
            Route(entry, self.entry),
            Route(entry + "/{what}", self.download),
            Route(self.path + "/{action}", self.act, methods=["POST"]),
        ]

    # -- what each quarantine says ------------------------------------------------
    @abc.abstractmethod
    def where(self, request: Request, form: FormData | None = None) -> W: ...

    @abc.abstractmethod
    def names(self, where: W) -> dict[str, Any]:
        """What its templates call the table."""

    @abc.abstractmethod
    async def confirm(self, request: Request) -> Response: ...

    @abc.abstractmethod
    async def apply(
        self, request: Request, where: W, action: str, form: FormData, expected: int | None
    ) -> Done: ...

    # -- the same for both ----------------------------------------------------------
    async def listing(self, request: Request) -> Response:
        site = self.site
        where = self.where(request)
        query = search_text(request)
        offset = page_offset(request)
        listing = await site.calls(self.reads.listing, where, query, offset, site.cfg.list_limit)
        listing_alone = request.headers.get("hx-request")
        return site.pages.render(
            request,
            f"_{self.kind.name}_listing.html" if listing_alone else f"{self.kind.name}.html",
            **self.names(where),
            q=console.shown(query),
            q_link=urllib.parse.urlencode({"q": query}) if query == console.shown(query) else "",
            listing=listing,
            limit=site.cfg.list_limit,
        )

    async def entry(self, request: Request) -> Response:
        where = self.where(request)
        number = one_row_number(request.path_params["number"], f"a {self.kind.noun}")
        found = await self.site.calls(self.reads.entry, where, number)
        if found is None:
            raise HTTPException(404, self.missing.format(number=number, table=where.table))
        return self.site.pages.render(request, self.entry_template, **self.names(where), **found)

    async def download(self, request: Request) -> Response:
        where = self.where(request)
        number = one_row_number(request.path_params["number"], f"a {self.kind.noun}")
        what = request.path_params["what"]
        if what not in self.kind.downloads:
            raise HTTPException(
                404, f"a {self.kind.noun}'s downloads are {', '.join(self.kind.downloads)}"
            )
        async with self.site.downloads:
            found = await self.site.calls(self.reads.value, where, number, what)
        return download(found, f"{self.files}-{number}-{what}", where.table)

    async def act(self, request: Request) -> Response:
        action = action_of(request.path_params["action"])
        form = await self.site.checked_form(request, f"{self.kind.name}.{action}")
        expected = expected_count(form)
        where = self.where(request, form)
        done = await self.apply(request, where, action, form, expected)
        audit(
            f"web.{self.kind.name}_{'retried' if action == 'retry' else 'purged'}",
            who=request.state.who,
            client=client_of(request),
            **audited_database(request),
            **done.audited,
        )
        verb = self.kind.retried if action == "retry" else "purged"
        return self.site.pages.render(
            request,
            "done.html",
            title=self.kind.title,
            message=f"{plural(done.count, self.kind.noun)} {verb}",
            count=done.count,
            expected=expected,
            rows=console.shown(done.rows),
            not_taken=console.shown(done.not_taken),
            back=f"{self.path}?{self.field}={where.table}",
        )


def numbers_of(values: list[str], field: str) -> tuple[int, ...]:
    """Row numbers from a query or a form, or a 400 saying which is not one."""
    try:
        return console.row_numbers(values, field)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None


def form_numbers(form: FormData, field: str) -> tuple[int, ...]:
    return numbers_of([str(v) for v in form.getlist(field)], field)


class DeadLetterPages(Pages[Settings]):
    """Dead letters: selected by row id, by a reason's rows, and by ordering key
    (named by one of its rows); a retry moves them back into the outbox."""

    kind = DEAD_LETTERS
    field = "table"
    entry_template = "dead_letter.html"
    reads = Reads(console.dead_letter_listing, console.dead_letter, console.dead_letter_value)
    missing = "no dead letter with row id {number} in {table}"
    files = "dead-letter"

    def where(self, request: Request, form: FormData | None = None) -> Settings:
        return self.site.outbox_of(request, form)

    def names(self, where: Settings) -> dict[str, Any]:
        return {"table": where.table}

    async def confirm(self, request: Request) -> Response:
        site = self.site
        settings = self.where(request)
        action = action_of(request.query_params.get("action"))
        params = request.query_params
        if "key" in params or "reason" in params:
            raise HTTPException(
                400, "keys and reasons are selected by one of their rows (key_of=…, reason_of=…)"
            )
        ids = numbers_of(params.getlist("id"), "id")
        reason_of = numbers_of(params.getlist("reason_of"), "reason_of")
        key_of = numbers_of(params.getlist("key_of"), "key_of")
        if len(reason_of) > 1:
            raise HTTPException(400, "reason_of names one row (a group at a time)")
        selection = await site.calls(
            lambda: console.select_dead_letters(
                settings,
                ids,
                reason_of=reason_of[0] if reason_of else None,
                key_of=key_of,
                limit=site.cfg.list_limit,
            )
        )
        rows = await site.calls(console.plan_dead_letters, settings, selection) if selection else []
        # Posted back by number: the rows, and for each key a few of its rows.
        keyed: dict[str, list[int]] = {}
        for row in rows:
            if row["ordering_key"] in selection.ordering_keys:
                keyed.setdefault(row["ordering_key"], []).append(row["id"])
        return site.pages.render(
            request,
            "confirm_dead_letters.html",
            limit=site.cfg.list_limit,
            table=settings.table,
            action=action,
            row_ids=selection.row_ids,
            key_of=sorted(i for found in keyed.values() for i in found[:KEY_ROWS_POSTED]),
            keys=len(selection.ordering_keys),
            by_reason=bool(reason_of),
            rows=console.shown(rows),
        )

    async def apply(
        self, request: Request, where: Settings, action: str, form: FormData, expected: int | None
    ) -> Done:
        ids = form_numbers(form, "id")
        key_of = form_numbers(form, "key_of")
        if not (ids or key_of):
            raise HTTPException(400, "nothing selected")
        selection = await self.site.calls(
            lambda: console.select_dead_letters(where, ids, key_of=key_of, limit=0)
        )
        act = console.retry_dead_letters if action == "retry" else console.purge_dead_letters
        done = await self.site.calls(act, where, selection)
        return Done(
            len(done),
            done,
            [],
            {
                "table": where.table,
                "rows": len(done),
                "confirmed": expected,
                "row_ids": list(selection.row_ids),
                "ordering_keys": list(selection.ordering_keys),
            },
        )


class ParkedPages(Pages[InboxTarget]):
    """Parked messages: selected by row number and by a group (consumer and error,
    named by one of its rows); a retry sends them back to their queues."""

    kind = PARKED
    field = "inbox"
    entry_template = "parked_message.html"
    reads = Reads(console.parked_listing, console.parked_message, console.parked_value)
    missing = "no parked message {number} in {table}_parked"
    files = "parked"

    def where(self, request: Request, form: FormData | None = None) -> InboxTarget:
        return self.site.inbox_of(request, form)

    def names(self, where: InboxTarget) -> dict[str, Any]:
        return {"inbox": where.table, "inbox_where": where_dsn(where.dsn)}

    async def confirm(self, request: Request) -> Response:
        site = self.site
        target = self.where(request)
        action = action_of(request.query_params.get("action"))
        if "id" in request.query_params:
            raise HTTPException(400, "parked messages are selected by row number (row=…)")
        numbers = numbers_of(request.query_params.getlist("row"), "row")
        group_of = numbers_of(request.query_params.getlist("group_of"), "group_of")
        if len(group_of) > 1:
            raise HTTPException(400, "group_of names one row (a group at a time)")
        ids = await site.calls(
            lambda: console.select_parked(
                target,
                numbers,
                group_of=group_of[0] if group_of else None,
                limit=site.cfg.list_limit,
            )
        )
        rows = await site.calls(console.plan_parked, target, ids) if ids else []
        return site.pages.render(
            request,
            "confirm_parked.html",
            limit=site.cfg.list_limit,
            inbox=target.table,
            action=action,
            rows=console.shown(rows),
            by_group=bool(group_of),
        )

    async def apply(
        self,
        request: Request,
        where: InboxTarget,
        action: str,
        form: FormData,
        expected: int | None,
    ) -> Done:
        site = self.site
        numbers = form_numbers(form, "row")
        if not numbers:
            raise HTTPException(400, "nothing selected")
        ids = await site.calls(
            lambda: console.select_parked(where, numbers, limit=site.cfg.list_limit)
        )
        not_sent: list[Any] = []
        if action == "retry":
            retried, not_sent = await site.calls(
                console.retry_parked, where, site.config.amqp_url, ids
            )
            count, rows = len(retried), [{"message_id": m} for m in retried]
        else:
            count = await site.calls(console.purge_parked, where, ids) if ids else 0
            rows = []
        return Done(
            count,
            rows,
            [{"message_id": m, "why": why} for m, why in not_sent],
            {
                "inbox_table": where.table,
                "messages": count,
                "confirmed": expected,
                "message_ids": list(ids),
                "not_taken": len(not_sent),
            },
        )


def routes(site: Site) -> list[Route]:
    return [*DeadLetterPages(site).routes(), *ParkedPages(site).routes()]
