"""The console's overview (GET /) and its live part (GET /overview/live): a real server on
an ephemeral port, the test database, rows inserted directly."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import psycopg

from pepsi.config import Config
from pepsi.config.ini import parse_ini
from pepsi.config.parse import parse_config
from pepsi.db.queries import query_text
from pepsi.dispatch.services.live import CHANNEL, payloads
from pepsi.dispatch.services.metrics import Gauges, Snapshot
from pepsi.dispatch.stats import Counts
from pepsi.web import server
from pepsi.web.overview_data import OVERVIEW

STAGES = (
    "[stage-a]\nHANDLER = tests.stages:noop\nNEXT = b\n"
    "[stage-b]\nHANDLER = tests.stages:noop\nNEXT = amqp:done\nBOUNCE_STAGE = c\n"
    "[stage-c]\nHANDLER = tests.stages:noop\n"
)

Scenario = Callable[[aiohttp.ClientSession, str, server.Running], Awaitable[Any]]


def config(text: str = STAGES) -> Config:
    return parse_config(parse_ini(text, "test"))


def run(cfg: Config, dsn: str, scenario: Scenario) -> Any:
    async def main() -> Any:
        running = await server.start(cfg, dsn, ("127.0.0.1", 0))
        try:
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
                # no PASSWORD: the token's link, exchanged for a session
                async with http.get(running.link, allow_redirects=False) as exchanged:
                    assert exchanged.status == 303
                return await scenario(http, running.url.rstrip("/"), running)
        finally:
            await running.stop()

    return asyncio.run(main())


def insert(conn: psycopg.Connection[Any], stage: str, status: str, n: int, age: str = "0s") -> None:
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status, arrived)"
        " SELECT %s, %s::pepsi.workqueue_status, now() - %s::interval FROM generate_series(1, %s)",
        (stage, status, age, n),
    )


def cell(page: str, element_id: str) -> str:
    found = re.search(rf'id="{re.escape(element_id)}"[^>]*>([^<]*)<', page)
    assert found is not None, f"no element {element_id}"
    return found.group(1).strip()


async def get(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.text()


def test_the_overview_shows_counts_graph_oldest_pending_and_chart(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        insert(conn, "a", "pending", 3, "2 hours")  # the oldest: 2h
        insert(conn, "a", "pending", 2)
        insert(conn, "a", "failed", 1)
        insert(conn, "b", "pending", 4, "90 seconds")
        insert(conn, "b", "timeout", 2)
        insert(conn, "amqp:/:done", "pending", 5)
        conn.execute(
            "INSERT INTO pepsi.stage_stats (stage, processed, failed, updated)"
            " VALUES ('a', 100, 3, now()), ('b', 50, 0, now())"
        )

        async def scenario(http: aiohttp.ClientSession, base: str, running: Any) -> None:
            state = running.runner.app[OVERVIEW]
            page = await get(http, f"{base}/")
            assert 'data-live="/overview/live"' in page
            assert (cell(page, "pending-a"), cell(page, "failed-a")) == ("5", "1")
            assert (cell(page, "pending-b"), cell(page, "timeout-b")) == ("4", "2")
            assert cell(page, "pending-c") == "0"
            assert cell(page, "pending-amqp:/:done") == "5"
            assert cell(page, "oldest-a").startswith("2h")
            assert cell(page, "oldest-b") in ("1m30s", "1m31s", "1m32s")
            assert cell(page, "oldest-c") == "–"
            assert "no dispatcher is running" in page
            assert 'data-source="database"' in page  # workers: no dispatcher here
            # the graph: a node per stage and for the queue, an edge per NEXT and bounce
            svg = page[page.index('<svg xmlns="http://www.w3.org/2000/svg" class="stage-graph"') :]
            svg = svg[: svg.index("</svg>")]
            nodes = re.findall(
                r'<a class="node node-(\w+)" href="([^"]+)" data-stage="([^"]+)"', svg
            )
            assert sorted(nodes) == [
                ("amqp", "/stage/amqp%3A%2F%3Adone", "amqp:/:done"),
                ("stage", "/stage/a", "a"),
                ("stage", "/stage/b", "b"),
                ("stage", "/stage/c", "c"),
            ]
            edges = re.findall(
                r'class="edge edge-(\w+)" data-source="([^"]+)" data-target="([^"]+)"', svg
            )
            assert sorted(edges) == [
                ("bounce", "b", "c"),
                ("next", "a", "b"),
                ("next", "b", "amqp:/:done"),
            ]
            assert "5 pend · 0 run · 1 fail" in svg  # a's backlog on its node
            # the chart: the day's minutes the dispatcher's flushes wrote (this console saw
            # none of them happen), in this quarter, three hours ago, and too long ago
            conn.execute(
                "INSERT INTO pepsi.stage_stats_minute VALUES"
                " (date_trunc('minute', now()), 'a', 10, 2),"
                " (date_trunc('minute', now()), 'b', 10, 0),"
                " (date_trunc('minute', now()) - interval '3 hours', 'b', 5, 0),"
                " (date_trunc('minute', now()) - interval '2 days', 'b', 100, 0)"
            )
            state.cached, state.chart = None, None  # read again (no cache, no CHART_EVERY)
            page = await get(http, f"{base}/overview/live")
            assert "<html" not in page
            assert 'id="stage-table"' in page
            assert (cell(page, "chart-processed"), cell(page, "chart-failed")) == ("25", "2")
            assert page.count('class="bar-processed"') == 2
            assert page.count('class="bar-failed"') == 1
            assert "a: 10 processed, 2 failed" in page
            assert "b: 10 processed, 0 failed" in page
            # a new row shows in the fragment; it answers fast
            insert(conn, "c", "pending", 1)
            state.cached = None
            started = time.monotonic()
            fragment = await get(http, f"{base}/overview/live")
            assert time.monotonic() - started < 4.0
            assert cell(fragment, "pending-c") == "1"
            assert cell(fragment, "oldest-c") in ("&lt;1s", "1s", "2s", "3s", "4s")

        run(config(), dsn, scenario)


def test_zero_stages_and_an_empty_database_render(dsn: str) -> None:
    async def scenario(http: aiohttp.ClientSession, base: str, running: Any) -> None:
        page = await get(http, f"{base}/")
        assert "No stages configured" in page
        assert 'id="rate-chart"' in page
        assert cell(page, "chart-processed") == "0"
        fragment = await get(http, f"{base}/overview/live")
        assert 'id="no-stages"' in fragment

    run(config(""), dsn, scenario)


def test_a_database_without_the_schema_is_an_error_box_not_a_crash(empty_dsn: str) -> None:
    async def scenario(http: aiohttp.ClientSession, base: str, running: Any) -> None:
        async with http.get(f"{base}/") as page:
            assert page.status == 503
            assert 'id="warning-database"' in await page.text()
        fragment = await get(http, f"{base}/overview/live")
        assert "Cannot read the database" in fragment

    run(config(), empty_dsn, scenario)


def test_the_oldest_pending_query_probes_the_index(dsn: str) -> None:
    """No scan of the backlog: one index probe per stage, at the head of its range."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        insert(conn, "a", "pending", 20000)
        conn.execute("ANALYZE pepsi.workqueue")
        text = query_text("web_overview_oldest_pending").replace("%(stages)s", "ARRAY['a', 'b']")
        plan = "\n".join(
            str(row[0])
            for row in conn.execute(f"EXPLAIN (ANALYZE, COSTS OFF) {text}").fetchall()  # type: ignore[arg-type]
        )
        assert "workqueue_pending_idx" in plan, plan
        assert "Seq Scan on workqueue" not in plan, plan
        assert "Sort" not in plan, plan
        assert "Rows Removed by Filter" not in plan, plan


async def until(condition: Callable[[], bool], what: str, limit: float = 15.0) -> None:
    """Wait for `condition` (checked every 20 ms); fail after `limit` seconds."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.02)

    try:
        await asyncio.wait_for(poll(), limit)
    except TimeoutError:
        raise AssertionError(f"still not {what} after {limit}s") from None


def test_rates_come_from_the_live_feed_once_a_snapshot_arrives(dsn: str) -> None:
    async def scenario(http: aiohttp.ClientSession, base: str, running: Any) -> None:
        state = running.runner.app[OVERVIEW]
        page = await get(http, f"{base}/")
        # no snapshot, no dispatcher: the statistics say nothing is processed
        assert 'id="rates-source" class="rates-stats"' in page
        assert cell(page, "rate-processed-a") == "0.0/s"
        await until(lambda: state.listening, "listening")
        now = time.time()
        snapshot = Snapshot(
            Counts({"a": Counter(processed=120, failed=12)}),
            Gauges(workers={"a": 2}, in_flight={"a": 3}, started=now - 12),
        )
        texts = payloads(
            snapshot, seq=12, at=now, quiet_since=now, interval=1.0, heartbeat=10.0, pid=4242
        )
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            for text in texts:
                await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, text))
        await until(lambda: state.rates.last is not None, "fed a snapshot")
        state.cached = None
        fragment = await get(http, f"{base}/overview/live")
        assert 'data-source="live"' in fragment
        assert "live: the dispatcher" in fragment
        assert (cell(fragment, "inflight-a"), cell(fragment, "workers-a")) == ("3", "2")
        processed = cell(fragment, "rate-processed-a")
        assert processed.endswith("/s")
        assert 0 < float(processed.removesuffix("/s")) <= 10.0  # 120 over 12 s at most
        assert cell(fragment, "rate-processed-b") == "0.0/s"  # not named: did nothing

    run(config(), dsn, scenario)
