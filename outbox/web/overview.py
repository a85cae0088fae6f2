"""The console's overview: every outbox's status and dead letters by reason, every
inbox's parked messages, and the charts (``sampler``); its panel is what htmx
reloads every few seconds."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from outbox.web.sampler import Sampler
from outbox.web.site import Site


def routes(site: Site, sampler: Sampler) -> list[Route]:
    async def render(request: Request, template: str) -> Response:
        sampler.start()
        data = await site.calls(sampler.overview)
        return site.pages.render(request, template, **data, charts=sampler.charts())

    async def overview(request: Request) -> Response:
        return await render(request, "overview.html")

    async def overview_panel(request: Request) -> Response:
        return await render(request, "_overview_panel.html")

    return [Route("/", overview), Route("/overview/panel", overview_panel)]
