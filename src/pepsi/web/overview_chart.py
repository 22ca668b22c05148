"""The overview's chart: the last day's counts per stage, read and cut into bars.

The dispatcher's statistics flushes keep the last day's per-minute counts in
`pepsi.stage_stats_minute`; `read_chart` reads them binned in bars of
BAR_MINUTES (`web_overview_chart`), with the server's clock, and `chart_bars`
(pure) makes the CHART_BARS bars up to now's that `pepsi.web.graph` draws.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from pepsi.db.queries import query
from pepsi.web import graph

CHART_BARS, BAR_MINUTES = 96, 15  # the chart: the last 24 hours in quarters

Conn = psycopg.Connection[Any]
ChartRow = tuple[datetime, str, int, int]  # a bar's start, stage, processed, failed


def chart_bars(
    rows: Iterable[ChartRow], now: datetime, bars: int = CHART_BARS, minutes: int = BAR_MINUTES
) -> list[graph.Bar]:
    """The `bars` bars of `minutes` up to now's, oldest first, from per-bar counts per stage
    (bars start on multiples of `minutes` since midnight UTC, as the query bins them)."""
    width = timedelta(minutes=minutes)
    epoch = datetime(2000, 1, 1, tzinfo=UTC)
    last = epoch + (now - epoch) // width * width
    counts: dict[datetime, dict[str, tuple[int, int]]] = {}
    for start, stage, processed, failed in rows:
        by_stage = counts.setdefault(start, {})
        p, f = by_stage.get(stage, (0, 0))
        by_stage[stage] = (p + processed, f + failed)
    out = []
    for back in range(bars - 1, -1, -1):
        start = last - back * width
        by_stage = counts.get(start, {})
        out.append(
            graph.Bar(
                label=start.astimezone(now.tzinfo).strftime("%H:%M"),
                processed=sum(p for p, _ in by_stage.values()),
                failed=sum(f for _, f in by_stage.values()),
                by_stage=dict(by_stage),
            )
        )
    return out


@dataclass(frozen=True)
class Chart:
    now: datetime  # the server's clock
    rows: tuple[ChartRow, ...]


def read_chart(conn: Conn) -> Chart:
    """The last day's counts per bar and stage (`web_overview_chart`), and the server's clock."""
    rows = conn.execute(query("web_overview_chart"), {"minutes": BAR_MINUTES}).fetchall()
    return Chart(
        rows[0][0],
        tuple((start, str(stage), int(p), int(f)) for _, start, stage, p, f in rows if stage),
    )
