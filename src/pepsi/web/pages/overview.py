"""The overview page (GET /) and its live part (GET /overview/live).

The page draws the stage graph, a table per stage (backlog by status, oldest
pending row, in-flight messages and workers, rates), the last hour's chart
and the warnings; its dynamic part is the fragment at /overview/live, which
static/console.js fetches again every REFRESH seconds (`data-live`). Without
JavaScript the page is the same, as of its loading. The data is
`pepsi.web.overview_data`.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from aiohttp import web
from markupsafe import Markup

from pepsi.durations import format_duration
from pepsi.errors import PepsiError, one_line
from pepsi.web import overview_data
from pepsi.web.app import CONSOLE, console_of
from pepsi.web.overview_data import OVERVIEW, OverviewState

REFRESH = 2  # seconds between two fetches of the live part
log = logging.getLogger("pepsi.web")


def _rate(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.0f}/s" if value >= 100 else f"{value:.1f}/s"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return "<1s" if seconds < 1 else format_duration(seconds)


async def _context(request: web.Request) -> dict[str, Any]:
    console = console_of(request)
    try:
        data = await overview_data.overview(request.app[OVERVIEW], console)
    except (psycopg.Error, PepsiError) as exc:  # the database is down, or has no schema
        log.warning("web: overview: %s", one_line(exc))
        return {"o": None, "error": one_line(exc), "refresh": REFRESH}
    return {
        "error": None,
        "o": data,
        "graph": Markup(data.graph_svg),  # noqa: S704  # built escaped by pepsi.web.graph
        "chart": Markup(data.chart_svg),  # noqa: S704
        "rate": _rate,
        "age": _age,
        "refresh": REFRESH,
        "stats_interval": console.config.dispatch.stats_interval,
    }


async def overview(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    context = await _context(request)
    response = console.render(request, "overview.html", **context)
    if context["error"]:
        response.set_status(503)  # the fragment stays 200: the page shows why, live
    return response


async def overview_live(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    response = console.render(request, "overview_live.html", **await _context(request))
    response.headers["Cache-Control"] = "no-store"
    return response


def setup(app: web.Application) -> None:
    app[OVERVIEW] = OverviewState()
    app.router.add_get("/", overview)
    app.router.add_get("/overview/live", overview_live)
    app.cleanup_ctx.append(overview_data.lifecycle(app[CONSOLE]))
