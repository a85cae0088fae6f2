"""The console's overview: every outbox's status and dead letters by reason, every
inbox's parked messages, and the charts (``sampler``); its panel is what htmx
reloads every few seconds.  A console of many databases (``databases``) shows every
database's figures at ``/``, and one database's overview, without charts, at
``/db/<name>/`` (``outbox.web.fleet``)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from outbox.web.fleet import Databases
from outbox.web.sampler import Sampler
from outbox.web.site import Site, target_of


def routes(site: Site, sampler: Sampler, databases: Databases | None = None) -> list[Route]:
    async def render(request: Request, template: str, of_all: str) -> Response:
        if databases is None:
            sampler.start()
            data = await site.calls(sampler.overview)
            return site.pages.render(request, template, **data, charts=sampler.charts())
        target = target_of(request)
        if target is None:
            fleet = await site.calls(databases.overview)
            return site.pages.render(request, of_all, **fleet)
        data = await site.calls(databases.database_overview, target)
        return site.pages.render(request, template, **data, charts=[])

    async def overview(request: Request) -> Response:
        return await render(request, "overview.html", "fleet.html")

    async def overview_panel(request: Request) -> Response:
        return await render(request, "_overview_panel.html", "_fleet_panel.html")

    return [Route("/", overview), Route("/overview/panel", overview_panel)]
