"""The console's in-doubt batches: what the database says (a GET), the resolver's
dry run and a resolver pass (POSTs: the dry run appends a probe record to the ledger
stream, and a GET must not write)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from outbox.web import console
from outbox.web.site import Site, audit, audited_database, client_of


def routes(site: Site) -> list[Route]:
    async def in_doubt(request: Request) -> Response:
        # What the database says, and nothing more: the resolver's dry run appends a
        # probe record to the ledger stream (to know where it ends), and a GET must
        # not write (an <img> on any web page can send one).  The dry run is a POST.
        settings = site.outbox_of(request)
        report = await site.calls(console.status_report, settings, site.cfg)
        return site.pages.render(
            request,
            "in_doubt.html",
            table=settings.table,
            batches=report["prepared_batches"],
            results=None,
            applied=False,
        )

    async def dry_run(request: Request) -> Response:
        form = await site.checked_form(request, "resolve_dry_run")
        settings = site.outbox_of(request, form)
        results = await site.calls(lambda: console.resolve_pass(settings, dry_run=True))
        return site.pages.render(
            request, "in_doubt.html", table=settings.table, results=results, applied=False
        )

    async def resolve(request: Request) -> Response:
        form = await site.checked_form(request, "resolve")
        settings = site.outbox_of(request, form)
        results = await site.calls(lambda: console.resolve_pass(settings, dry_run=False))
        finished = [r for r in results if r.finished]
        audit(
            "web.resolved",
            who=request.state.who,
            client=client_of(request),
            **audited_database(request),
            table=settings.table,
            batches=len(results),
            committed=sum(1 for r in results if r.outcome == "committed"),
            rolled_back=sum(1 for r in results if r.outcome == "rolled_back"),
            gids=[r.gid for r in finished],
        )
        return site.pages.render(
            request, "in_doubt.html", table=settings.table, results=results, applied=True
        )

    return [
        Route("/in-doubt", in_doubt),
        Route("/in-doubt/dry-run", dry_run, methods=["POST"]),
        Route("/in-doubt/resolve", resolve, methods=["POST"]),
    ]
