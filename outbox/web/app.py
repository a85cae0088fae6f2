"""The console's web application (Starlette): the routes of each resource
(``overview``, ``quarantine``, ``indoubt``) over what they share (``site``), the
error pages, and the rules of ``security``.

Pages are rendered on the server with Jinja2 (autoescaped); every text they show
from the database, the broker or a client was masked where it was read
(``console.shown``), so no password of a connection setting reaches a browser,
whatever a row or a driver's error message quoted (``site.Pages``).  htmx refreshes the
overview and filters the lists; every action also works as a plain HTML form.

Reads are GETs and change nothing.  Every change is a POST from a confirmation
page that showed what it would touch and how many; the POST must carry this
process's CSRF token (``security``), is refused in ``--read-only`` mode, and is
logged with who asked, what and how many (``web.*`` events).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles

from outbox import redaction
from outbox.errors import BrokerUnavailable, DatabaseUnavailable, OutboxError, RowsHeld
from outbox.redaction import redact
from outbox.web import console, indoubt, overview, quarantine, security
from outbox.web.fleet import DatabasePrefix, Databases
from outbox.web.sampler import Sampler
from outbox.web.site import (
    HERE,
    Guard,
    Site,
    WebConfig,
    audit,
    loggable,
    where_amqp,
    where_dsn,
    with_headers,
)


def create_app(
    config: WebConfig,
    *,
    csrf_keys: security.CsrfKeys | None = None,
    throttle: security.Throttle | None = None,
) -> Starlette:
    """The console as an ASGI application (``server.serve`` runs it with uvicorn)."""
    keys = csrf_keys or security.CsrfKeys()
    # The CLI's option types remember these already; an embedding application may not.
    redaction.remember(
        *(s.dsn for s in config.console.outboxes),
        *(t.dsn for t in config.console.inboxes),
        config.amqp_url,
    )
    site = Site(config, keys)
    sampler = Sampler(config.console)
    databases = None if config.targets is None else Databases(config.targets, config.console)
    routes: list[BaseRoute] = [
        *overview.routes(site, sampler, databases),
        *quarantine.routes(site),
        *indoubt.routes(site),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if databases is None:  # a console of many databases has no charts
            sampler.start()
        try:
            yield
        finally:
            await site.calls(sampler.stop)

    return Starlette(
        lifespan=lifespan,
        routes=routes,
        middleware=[
            Middleware(Guard, config=config, keys=keys, throttle=throttle or security.Throttle()),
            # Inside the guard: nothing is looked up before a request is authenticated.
            *([] if databases is None else [Middleware(DatabasePrefix, databases=databases)]),
        ],
        exception_handlers=_error_pages(site),
    )


def _error_pages(site: Site) -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return with_headers(
            site.pages.render(
                request,
                "error.html",
                status_code=exc.status_code,
                message=redact(str(exc.detail)),
                held_by=[],
                table="",
            )
        )

    async def outbox_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OutboxError)
        if isinstance(exc, RowsHeld):
            status = 409
        elif isinstance(exc, DatabaseUnavailable | BrokerUnavailable):
            status = 503
        else:
            status = 500
        audit("web.error", path=loggable(request.url.path), error=exc.message)
        return with_headers(
            site.pages.render(
                request,
                "error.html",
                status_code=status,
                message=console.describe(exc),
                # The button that releases the rows, for the table the action was on.
                held_by=exc.gids if isinstance(exc, RowsHeld) else [],
                table=request.scope.get("outbox_table", site.cfg.outboxes[0].table),
            )
        )

    return {HTTPException: http_error, OutboxError: outbox_error}


__all__: Sequence[str] = ["WebConfig", "create_app", "where_amqp", "where_dsn"]
