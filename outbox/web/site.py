"""What every page of the console shares: its configuration (``WebConfig``), the
rendering of templates (``Pages``), the calls that block (``Calls``), the guard every
request passes (``Guard``), the checks of a state-changing POST (``Site.checked_form``)
and the audit log (``audit``).

The pages themselves are grouped by resource, each module with its own short list
of routes: ``overview``, ``quarantine`` (dead letters and parked messages) and
``indoubt`` (in-doubt batches); ``app`` puts them together.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import pathlib
import re
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import jinja2
from starlette.convertors import Convertor, register_url_convertor
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response

from outbox import urls
from outbox.config import Settings
from outbox.events import emit
from outbox.fleet.targets import Target, TargetSource
from outbox.redaction import redact
from outbox.web import console, security
from outbox.web.console import ConsoleConfig, InboxTarget

log = logging.getLogger("outbox.web")

HERE = pathlib.Path(__file__).parent
# The most database and broker calls the console runs at once (``Calls``); a request
# beyond waits, without a thread, for one to end.
CALLS_AT_ONCE = 16
T = TypeVar("T")


class Calls:
    """Runs the console's blocking calls (database, broker), each on a thread of its
    own that ends with it, at most ``most`` at once.

    Every call is bounded (the sessions' client deadline, ``outbox.db.session``; the
    broker's timeouts), so a request is answered, if only with an error page, within
    a bounded time, and a slot frees within that time too.  Unlike a thread pool, no
    idle thread is left behind, and a slot is freed when its thread ends, not when a
    request that gave up stops waiting for it: there are never more than ``most``
    call threads, nor more sessions on PostgreSQL.
    """

    def __init__(self, most: int = CALLS_AT_ONCE) -> None:
        self.most = most
        self._slots: asyncio.Semaphore | None = None  # made in the server's loop

    async def __call__(self, call: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.most)
        slots = self._slots
        await slots.acquire()
        answer: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            slots.release()
            if answer.cancelled():
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(result)  # type: ignore[arg-type]

        def run(context: contextvars.Context) -> None:
            result: T | None = None
            error: BaseException | None = None
            try:
                result = context.run(call, *args)
            except BaseException as exc:  # handed to the request, as the pool would
                error = exc
            with contextlib.suppress(RuntimeError):  # the server's loop is closed
                loop.call_soon_threadsafe(settle, result, error)

        try:
            threading.Thread(
                target=run, args=(contextvars.copy_context(),), name="outbox-web-call", daemon=True
            ).start()
        except BaseException:
            slots.release()
            raise
        return await answer


# The longest form a POST may send: a page of ids (1,000 parked message ids of up to
# 255 bytes, percent-encoded) fits; a longer body is refused before it is read.
MAX_FORM_BYTES = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class WebConfig:
    """What ``outbox web`` was given: the tables, the broker, who may come in."""

    console: ConsoleConfig
    amqp_url: str
    credentials: security.Credentials
    host: str = "127.0.0.1"
    # Addresses of reverse proxies whose X-Forwarded-For / -Proto headers are believed
    # (the audit field ``client=`` then names the proxy's client).  Empty: the headers
    # are ignored and ``client=`` is the peer address, which no request can forge.
    trusted_proxies: tuple[str, ...] = ()
    # Many databases (``--targets``/``--discover``): an overview of all of them and
    # each one's pages under /db/<name>/ (``outbox.web.fleet``); None: ``--dsn``'s.
    targets: TargetSource | None = None


# A database's pages in a console of many (``outbox.web.fleet``): under this prefix,
# its target in the request's scope under this key.
DB_PREFIX = "/db/"
DB_SCOPE_KEY = "outbox_target"


def audited_database(request: Request) -> dict[str, str]:
    """The ``database`` field of an action's audit entry in a console of many."""
    target = target_of(request)
    return {} if target is None else {"database": target.name}


def target_of(request: Request) -> Target | None:
    """The database a request is for, in a console of many (None: no database chosen,
    or a console of one)."""
    target = request.scope.get(DB_SCOPE_KEY)
    return target if isinstance(target, Target) else None


def where_dsn(dsn: str) -> str:
    """A DSN without its password: ``user@host:port/dbname``."""
    try:
        parts = urls.check_dsn(dsn)
    except urls.InvalidUrl:
        return "(a DSN that cannot be read)"
    user = f"{parts['user']}@" if parts.get("user") else ""
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"{user}{parts.get('host') or 'localhost'}{port}/{parts.get('dbname', '')}"


def where_amqp(url: str) -> str:
    try:
        return " ; ".join(u.describe() for u in urls.parse_amqp_urls(url))
    except urls.InvalidUrl:
        return "(a URL that cannot be read)"


class Pages:
    """Renders templates (autoescaped).

    No password reaches a page, and nothing on a page is rewritten after it is
    rendered: every text a page shows from the database, the broker or a client
    was masked where it was read (``console.shown``, ``redact``), before it is
    escaped; links and forms name rows by number only, never by a text that
    masking would change; what comes from the configuration (table names, the
    CSRF token, the DSN without its password) is put in as it is.
    """

    def __init__(self, config: WebConfig) -> None:
        self.config = config
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.env.filters["age"] = _age
        self.env.filters["short"] = _short
        self.env.filters["plural"] = plural
        # For the few values a template gets as objects (a resolver's results).
        self.env.filters["masked"] = redact

    def render(
        self, request: Request, name: str, status_code: int = 200, **context: Any
    ) -> Response:
        cfg = self.config.console
        target = target_of(request)
        many = self.config.targets is not None
        if target is not None:
            where = where_dsn(target.dsn)
        elif many:
            assert self.config.targets is not None
            where = self.config.targets.describe()
        else:
            where = where_dsn(cfg.outboxes[0].dsn)
        base = {
            "fleet": many,
            "db_name": target.name if target else "",
            "db_root": DB_PREFIX + urllib.parse.quote(target.name, safe="/:") if target else "",
            "request": request,
            "who": getattr(request.state, "who", ""),
            "csrf": getattr(request.state, "csrf", ""),
            "read_only": cfg.read_only,
            "refresh_ms": round(cfg.refresh_seconds * 1000),
            "outbox_tables": [s.table for s in cfg.outboxes],
            "inbox_tables": [t.table for t in cfg.inboxes],
            "outbox_where": where,
            "amqp_where": where_amqp(self.config.amqp_url),
        }
        html = self.env.get_template(name).render(**base, **context)
        return HTMLResponse(html, status_code=status_code)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.1f}s"


def _short(text: object, most: int = 80) -> str:
    value = "" if text is None else str(text)
    return value if len(value) <= most else value[: most - 1] + "…"


class Guard(BaseHTTPMiddleware):
    """Authentication, the CSRF cookie, and the headers every response carries."""

    def __init__(
        self, app: Any, config: WebConfig, keys: security.CsrfKeys, throttle: security.Throttle
    ) -> None:
        super().__init__(app)
        self.config = config
        self.keys = keys
        self.throttle = throttle

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        if not self.config.credentials and not security.addressed_locally(
            request.headers.get("host")
        ):
            audit(
                "web.refused",
                why="Host is not a loopback name",
                host=loggable(request.headers.get("host") or ""),
                client=client_of(request),
                path=loggable(request.scope["path"]),
            )
            return with_headers(
                PlainTextResponse(
                    "this console answers only to 127.0.0.1, localhost or [::1] without "
                    f"credentials: set {security.TOKEN_ENV}, or {security.USER_ENV} and "
                    f"{security.PASSWORD_ENV}, to reach it by another name",
                    status_code=421,
                )
            )
        client = client_of(request)
        if self.config.credentials and not self.throttle.allowed(client):
            # Refused without looking at the credentials: a guess sent now tells nothing.
            return with_headers(
                PlainTextResponse(
                    "too many failed attempts to authenticate: try again later",
                    status_code=429,
                    headers={"Retry-After": str(self.throttle.retry_after(client))},
                )
            )
        authorization = request.headers.get("authorization")
        who = security.authenticate(authorization, self.config.credentials)
        if who is None and authorization:  # a guess (no header: a browser's first visit)
            self.throttle.failed(client)
            if not self.throttle.allowed(client):
                audit(
                    "web.throttled",
                    client=loggable(client),
                    retry_after=self.throttle.retry_after(client),
                )
        if who is None:
            audit(
                "web.refused",
                why="not authenticated",
                client=client_of(request),
                path=loggable(request.url.path),
            )
            return with_headers(
                PlainTextResponse(
                    "authentication required",
                    status_code=401,
                    headers={"WWW-Authenticate": 'Basic realm="outbox console", charset="UTF-8"'},
                )
            )
        request.state.who = who
        cookie_name = security.csrf_cookie(request.headers.get("host"))
        cookie = request.cookies.get(cookie_name)
        fresh = not self.keys.valid(cookie)
        request.state.csrf = self.keys.issue() if fresh else cookie
        response = await call_next(request)
        if fresh:
            response.set_cookie(
                cookie_name,
                request.state.csrf,
                httponly=True,
                samesite="strict",
                secure=request.url.scheme == "https",
            )
        return with_headers(response)


def with_headers(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    )
    response.headers["X-Frame-Options"] = "DENY"
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "same-origin"
    response.headers["Cache-Control"] = "no-store"
    return response


def loggable(text: str, most: int = 200) -> str:
    """Text a client chose, safe for a log line: no newline or control character can
    forge another entry, and no blank can make one field read as two
    (``path=/a rows=5000``).  Non-ASCII and backslashes are escaped too, so the
    escaping cannot be undone by text that imitates it."""
    return text[:most].encode("unicode_escape").decode("ascii").replace(" ", "\\x20")


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _one_line(value: Any) -> Any:
    """Every string of an audit field with its control characters escaped."""
    if isinstance(value, str):
        return _CONTROL.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), value)
    if isinstance(value, list | tuple):
        return [_one_line(v) for v in value]
    return value


def audit(event: str, **fields: Any) -> None:
    """A ``web.*`` event (WARNING): who did what, or was refused.  Whatever a field
    holds, the entry stays one line in both log formats."""
    emit(log, event, logging.WARNING, **{k: _one_line(v) for k, v in fields.items()})


def expected_count(form: FormData) -> int | None:
    """The ``expected`` field of a confirmation form: how many rows the page showed."""
    value = form.get("expected")
    if value is None or value == "":
        return None
    if not (isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 10):
        raise HTTPException(400, "expected is the count of rows the page showed (a number)")
    return int(value)


def client_of(request: Request) -> str:
    """The peer's address, or what a --trusted-proxy forwarded (its client's text)."""
    return loggable(request.client.host) if request.client else "?"


class Site:
    """What the console's pages share in one application: the configuration, the
    pages, the calls, the CSRF keys, and the checks every request's input passes."""

    def __init__(self, config: WebConfig, keys: security.CsrfKeys) -> None:
        self.config = config
        self.cfg = config.console
        self.keys = keys
        self.pages = Pages(config)
        self.calls = Calls()
        # Two downloads at a time: each may hold DOWNLOAD_MOST bytes.
        self.downloads = anyio.Semaphore(2)

    async def checked_form(self, request: Request, what: str) -> FormData:
        """The form of a state-changing POST, after the CSRF and read-only checks.

        Everything that can be checked without the body is checked before a byte of
        it is read (the Origin, the read-only mode, the CSRF cookie, the size it
        announces); the body is then read up to ``MAX_FORM_BYTES`` and no further,
        and only the token it carries is left to compare."""
        cookie = request.cookies.get(security.csrf_cookie(request.headers.get("host")))
        why = None
        if not security.same_origin(request.headers.get("origin"), request.headers.get("host")):
            why = "the request came from another site (Origin)"
        elif not self.keys.valid(cookie):
            why = "missing or wrong CSRF token: reload the page and try again"
        elif self.cfg.read_only:
            why = "the console runs with --read-only"
        if why is None:
            form = await self.bounded_form(request)
            submitted = form.get(security.CSRF_FIELD) or request.headers.get(security.CSRF_HEADER)
            if not self.keys.request_ok(cookie, submitted if isinstance(submitted, str) else None):
                why = "missing or wrong CSRF token: reload the page and try again"
        if why:
            audit(
                "web.refused",
                who=request.state.who,
                client=client_of(request),
                action=what,
                why=why,
            )
            raise HTTPException(403, why)
        return form

    async def bounded_form(self, request: Request) -> FormData:
        """An ``application/x-www-form-urlencoded`` body of at most ``MAX_FORM_BYTES``
        (413 before reading a longer one it announces, or as soon as a body without
        Content-Length grows past it)."""
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind not in ("", "application/x-www-form-urlencoded"):
            raise HTTPException(415, "the console's forms are application/x-www-form-urlencoded")
        announced = request.headers.get("content-length", "")
        too_long = f"the form is longer than {MAX_FORM_BYTES:,} bytes"
        if announced and (not announced.isdigit() or len(announced) > 12):
            raise HTTPException(400, "the Content-Length header is not a number of bytes")
        if announced and int(announced) > MAX_FORM_BYTES:
            raise HTTPException(413, too_long)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                raise HTTPException(413, too_long)
        try:
            fields: list[tuple[str, str | UploadFile]] = []
            fields += urllib.parse.parse_qsl(
                body.decode("ascii"),
                keep_blank_values=True,
                strict_parsing=False,
                encoding="utf-8",
                errors="strict",
                # A group's ids come back as fields: room for a whole page of them.
                max_num_fields=self.cfg.list_limit + 16,
            )
        except (UnicodeDecodeError, ValueError):
            raise HTTPException(
                400,
                "the form cannot be read: not URL-encoded UTF-8, or more fields than a page has",
            ) from None
        return FormData(fields)

    def outbox_of(self, request: Request, form: FormData | None = None) -> Settings:
        table = (form.get("table") if form else None) or request.query_params.get("table")
        try:
            settings = self.cfg.outbox(str(table) if table else None)
        except KeyError:
            raise HTTPException(404, f"no outbox table {table!r} is configured") from None
        request.scope["outbox_table"] = settings.table
        if self.config.targets is None:
            return settings
        target = target_of(request)
        if target is None:
            raise HTTPException(
                404,
                "this console serves many databases: choose one on the overview (/), "
                "its pages are under /db/<name>/",
            )
        return dataclasses.replace(settings, dsn=target.dsn)

    def inbox_of(self, request: Request, form: FormData | None = None) -> InboxTarget:
        table = (form.get("inbox") if form else None) or request.query_params.get("inbox")
        try:
            return self.cfg.inbox(str(table) if table else None)
        except KeyError:
            raise HTTPException(
                404,
                f"no inbox table {table!r} is configured (--inbox-table)"
                if table
                else "no inbox table is configured: start the console with --inbox-table",
            ) from None


class _Digits(Convertor[str]):
    """A path segment of digits, however many: the handler says why a number is not
    a row number (400) instead of Python's int() failing on 5,000 digits (500)."""

    regex = "[0-9]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("outbox_digits", _Digits())

# The longest filter text: ids, keys and reasons are shorter than this.
SEARCH_MOST = 500


def one_row_number(text: str, what: str) -> int:
    try:
        [number] = console.row_numbers([text], what)
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None
    return number


def search_text(request: Request) -> str:
    """The filter text of a list (``q``): 400 for what no row can contain."""
    text = request.query_params.get("q", "").strip()
    if "\x00" in text:
        raise HTTPException(400, "the filter cannot contain NUL (no text in PostgreSQL does)")
    if len(text) > SEARCH_MOST:
        raise HTTPException(400, f"the filter is longer than {SEARCH_MOST} characters")
    return text


def page_offset(request: Request) -> int:
    """Where a list's page starts (``offset``, a row count)."""
    text = request.query_params.get("offset", "0")
    if not (text.isascii() and text.isdigit() and len(text) <= 12):
        raise HTTPException(400, "offset is a number of rows to skip (a whole number)")
    return int(text)


def plural(count: int, noun: str) -> str:
    """``1 dead letter``, ``2 dead letters``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def download(found: console.Download | None, name: str, table: str) -> Response:
    if found is None:
        raise HTTPException(404, f"no such row in {table}")
    if found.value is None:
        raise HTTPException(
            413,
            f"{found.size:,} bytes is more than the console sends at once "
            f"({console.DOWNLOAD_MOST:,}): read it with psql",
        )
    return Response(
        found.value,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{name}.bin"'},
    )


def action_of(value: str | None) -> str:
    if value not in ("retry", "purge"):
        raise HTTPException(404, "the action is retry or purge")
    return value
