"""The live snapshot (NOTIFY pepsi_live) from a real dispatcher process, read by a
listener of ours and by `pepsi top`: rates within seconds while STATS_INTERVAL is its
default minute, and an idle dispatcher's heartbeat."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pepsi.admin.watch.live import LIVE, STOPPED
from pepsi.admin.watch.live_listener import AsyncLiveListener, LiveListener
from pepsi.admin.watch.live_snapshot import LiveSnapshot
from pepsi.dispatch.services.live import LIVE_HEARTBEAT, heartbeat_bound
from tests.scenarios.conftest import REPO, Pipeline, wait_until

HOLD_AND_B = (
    "[stage-hold]\nHANDLER = tests.stages:faulty_serial\nMAX_RUNTIME = 10m\n"
    "[stage-b]\nHANDLER = tests.stages:noop\n"
)


@pytest.fixture
def pipeline(dsn: str, tmp_path: Path) -> Iterator[Pipeline]:
    p = Pipeline(dsn, tmp_path)
    yield p
    p.close()


def status(pipeline: Pipeline, wid: int) -> str | None:
    row = pipeline.row(wid)
    return None if row is None else row[1]


def test_live_rates_while_busy_and_before_any_statistics_flush(pipeline: Pipeline) -> None:
    # STATS_INTERVAL is left at its default minute; a hanging message keeps the
    # pipeline busy, so no idle flush writes the statistics either.
    pipeline.configure(HOLD_AND_B)
    (held,) = pipeline.publish("hold", properties={"fault": "hang"})
    with psycopg.connect(pipeline.dsn, autocommit=True) as conn:
        listener = LiveListener(conn)
        listener.start()
        dispatcher = pipeline.start()
        wait_until(lambda: status(pipeline, held) == "running", what="the hang to be held")
        top = subprocess.Popen(
            [sys.executable, "-m", "pepsi", "-c", str(pipeline.conf), "top", "--json",
             "--interval", "0.2", "--count", "300"],
            env=pipeline.env(), cwd=REPO, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            pipeline.publish("b", count=300)

            def rated() -> object:
                listener.wait(0.1)
                view = listener.view()
                return view.available and (view.rate("b", "processed") or 0) > 0 and view

            view = wait_until(rated, timeout=15, what="a live processed rate for stage b")
            assert view.state == LIVE
            assert view.pid == dispatcher.proc.pid
            assert view.stages["hold"].in_flight == 1
            assert view.stages["hold"].workers == 1
            assert view.window is not None
            assert view.window <= 10.0
            assert (view.dispatch["claimed"] or 0) > 0
            # the rate did not come from the tables: the dispatcher has written nothing
            assert pipeline.scalar("SELECT count(*) FROM pepsi.stage_stats") == 0
            # (its start wrote the stages it serves, no counter)
            assert (
                pipeline.scalar("SELECT coalesce(sum(claimed), 0) FROM pepsi.dispatch_stats") == 0
            )

            # pepsi top shows the live rates, and says so
            assert top.stdout is not None
            shown = None
            for line in top.stdout:
                item = json.loads(line)
                stages = {s["stage"]: s for s in item["stages"]}
                if item["rates_source"] == "live" and stages["b"]["rates"]["processed"]:
                    shown = item
                    break
            assert shown is not None, "top ended without showing a live rate"
            assert shown["rate_window_s"] <= 10.0
            assert shown["dispatcher"]["running"]
        finally:
            top.kill()
            top.wait()
            if top.stdout is not None:
                top.stdout.close()

        # an asyncio reader (the web console's way) hears the busy dispatcher too, up
        # to the last of b's messages (they may still run: a loaded machine)
        async def last_snapshot() -> LiveSnapshot:
            async with await psycopg.AsyncConnection.connect(
                pipeline.dsn, autocommit=True
            ) as aconn:
                reader = AsyncLiveListener(aconn)
                await reader.start()
                async for snapshot in reader.snapshots(timeout=10):
                    if snapshot.stages["b"].counters["processed"] >= 300:
                        return snapshot
            raise AssertionError("no snapshot with b's 300 messages within 10 s")

        snapshot = asyncio.run(last_snapshot())
        assert snapshot.stages["b"].counters["processed"] == 300
        assert snapshot.interval == 1.0
        # a clean stop ends the hanging worker too (the fixture's SIGKILL of the
        # dispatcher would leave it sleeping its hour out)
        assert dispatcher.stop() == 0

        assert dispatcher.stop() == 0
        wait_until(
            lambda: listener.wait(0.1) or listener.view().state == STOPPED,
            what="the dispatcher's last snapshot",
        )


def test_an_idle_dispatcher_sends_heartbeats_not_a_snapshot_a_second(
    pipeline: Pipeline,
) -> None:
    pipeline.configure("[stage-a]\nHANDLER = tests.stages:noop\n")  # POLL_INTERVAL 1s
    with psycopg.connect(pipeline.dsn, autocommit=True) as conn:
        listener = LiveListener(conn)
        listener.start()
        dispatcher = pipeline.start()
        pipeline.publish("a", count=20)
        heard: list[LiveSnapshot] = []

        def a_heartbeat() -> tuple[LiveSnapshot, LiveSnapshot] | None:
            """Two snapshots in a row of a dispatcher without workers, nothing changed."""
            heard.extend(listener.snapshots(0.2))
            for before, after in itertools.pairwise(heard):
                idle = all(s.workers == 0 and s.in_flight == 0 for s in after.stages.values())
                if idle and after.quiet_since <= before.at and before.stages == after.stages:
                    return before, after
            return None

        before, after = wait_until(a_heartbeat, timeout=40, what="an idle heartbeat")
        assert after.seq == before.seq + 1  # nothing sent between them
        assert after.stages["a"].counters["processed"] == 20
        bound = heartbeat_bound(LIVE_HEARTBEAT, 1.0)
        assert after.heartbeat == bound
        # not every second (the heartbeat is due LIVE_HEARTBEAT - POLL_INTERVAL / 2
        # after the last one), and within the bound readers are told
        assert LIVE_HEARTBEAT - 1.0 <= after.at - before.at <= bound + 1.0
        view = listener.view()
        assert view.state == LIVE
        assert view.rate("a", "processed") == 0.0  # idle: nothing over the last 10 s
        assert dispatcher.stop() == 0
