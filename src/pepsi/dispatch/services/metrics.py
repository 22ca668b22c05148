"""The dispatcher's optional Prometheus endpoint ([pepsi-dispatch] METRICS_ADDRESS).

It exposes the P-9 counters since the dispatcher started (flushed or not:
Prometheus computes rates itself and copes with a restart's reset) and a few
gauges of the pools. Those come from the dispatcher's memory: prometheus-client
serves HTTP on its own thread, and that thread asks the event loop for a
snapshot rather than reading the loop's structures while they change.

One gauge needs the database: the age of the oldest transaction holding back
vacuum (`pepsi.admin.horizon`). The scrape thread reads it on a connection of
its own (`horizon.Probe`, kept between scrapes), never on the loop or its claim
connection, at most every 5 s (a flood of scrapes reuses the last reading);
when it cannot, the gauge is left out of that scrape. The endpoint has no
authentication: a METRICS_ADDRESS off loopback draws a warning at start.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from pepsi.admin.horizon import Holder
from pepsi.config.values import host_port
from pepsi.dispatch.stats import OUTCOME_COUNTERS, WAKEUP_CAUSES, Counts
from pepsi.errors import DatabaseUnavailable

log = logging.getLogger("pepsi.dispatch")

SNAPSHOT_TIMEOUT = 5.0

# dispatch_stats column -> (metric name without _total, help)
DISPATCH_COUNTERS = {
    "claims": ("pepsi_claims", "Claim statements that took rows"),
    "claimed": ("pepsi_claimed_messages", "Rows claimed (pending to running)"),
    "stages_executed": ("pepsi_worker_passes", "Status lines answered (a fused chain is one)"),
    "workers_started": ("pepsi_workers_started", "Worker processes started"),
    "workers_crashed": ("pepsi_workers_crashed", "Worker processes that died unasked"),
    "workers_retired": ("pepsi_workers_retired", "Worker processes stopped on purpose"),
    "paused_resumed": ("pepsi_paused_resumed", "Paused rows that fell due and were resumed"),
    "bodies_collected": ("pepsi_bodies_collected", "Orphan bodies removed by the sweep"),
    "backpressure_events": (
        "pepsi_backpressure_events",
        "Answers 75 (out of database connections): a stage's worker cap halved",
    ),
}


@dataclass(frozen=True)
class Gauges:
    """What the pools look like right now, per stage."""

    workers: dict[str, int] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    worker_limit: dict[str, int] = field(default_factory=dict)
    started: float = 0.0  # the dispatcher's start, Unix time
    # the message at the head of each worker: started; the rest a worker holds is read ahead
    executing: tuple[int, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    counts: Counts
    gauges: Gauges


def families(snapshot: Snapshot, stages: Sequence[str]) -> list[Metric]:
    """The metric families of one snapshot; every configured stage has its series."""
    counts, gauges = snapshot.counts, snapshot.gauges
    names = sorted(set(stages) | set(counts.stages))

    def stage_counter(key: str) -> list[tuple[str, int]]:
        return [(s, counts.stages[s][key] if s in counts.stages else 0) for s in names]

    passes = CounterMetricFamily(
        "pepsi_stage_passes", "Stage runs answered, by result", labels=["stage", "result"]
    )
    for result, key in (("ok", "processed"), ("failed", "failed")):
        for stage, n in stage_counter(key):
            passes.add_metric([stage, result], n)
    outcomes = CounterMetricFamily(
        "pepsi_stage_outcomes",
        "Outcomes the stages recorded, as their workers report them",
        labels=["stage", "outcome"],
    )
    for outcome, key in OUTCOME_COUNTERS.items():
        for stage, n in stage_counter(key):
            outcomes.add_metric([stage, outcome], n)
    out: list[Metric] = [passes, outcomes]
    for key, name, text in (
        ("strikes", "pepsi_stage_strikes", "Crashes and hangs charged to a message"),
        ("timed_out", "pepsi_stage_timeouts", "Workers killed past MAX_RUNTIME"),
        ("requeued", "pepsi_stage_requeued", "Messages given back to pending without running"),
    ):
        family = CounterMetricFamily(name, text, labels=["stage"])
        for stage, n in stage_counter(key):
            family.add_metric([stage], n)
        out.append(family)
    busy = CounterMetricFamily(
        "pepsi_stage_worker_seconds", "Worker time spent in the stage", labels=["stage"]
    )
    for stage, micros in stage_counter("busy_us"):
        busy.add_metric([stage], micros / 1_000_000)
    out.append(busy)
    for key, (name, text) in DISPATCH_COUNTERS.items():
        out.append(CounterMetricFamily(name, text, value=counts.dispatch.get(key, 0)))
    wakeups = CounterMetricFamily(
        "pepsi_wakeups", "Dispatcher loop wakeups, by cause", labels=["cause"]
    )
    for cause in WAKEUP_CAUSES:
        wakeups.add_metric([cause], counts.dispatch.get(f"wakeups_{cause}", 0))
    out.append(wakeups)
    for name, text, values in (
        ("pepsi_workers", "Live worker processes", gauges.workers),
        ("pepsi_in_flight_messages", "Messages handed to workers, not answered", gauges.in_flight),
        ("pepsi_worker_limit", "Workers the stage may run now (back-pressure included)",
         gauges.worker_limit),
    ):  # fmt: skip
        gauge = GaugeMetricFamily(name, text, labels=["stage"])
        for stage in names:
            gauge.add_metric([stage], values.get(stage, 0))
        out.append(gauge)
    out.append(
        GaugeMetricFamily(
            "pepsi_dispatcher_start_time_seconds",
            "When the dispatcher started, Unix time",
            value=gauges.started,
        )
    )
    return out


class _LoopCollector(Collector):
    """Collects on the scrape thread from a snapshot taken on the event loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        snapshot: Callable[[], Snapshot],
        stages: Sequence[str],
    ) -> None:
        self.loop, self.snapshot, self.stages = loop, snapshot, stages

    def collect(self) -> Iterable[Metric]:
        async def take() -> Snapshot:
            return self.snapshot()

        future = asyncio.run_coroutine_threadsafe(take(), self.loop)
        try:
            return families(future.result(SNAPSHOT_TIMEOUT), self.stages)
        except FutureTimeout:
            future.cancel()
            log.warning("metrics: the dispatcher loop did not answer within %ss", SNAPSHOT_TIMEOUT)
            return []


def horizon_families(holder: Holder | None) -> list[Metric]:
    """The oldest transaction holding back vacuum: its age, and its backend's pid as a
    value rather than a label (a label per pid would be a new series per session)."""
    return [
        GaugeMetricFamily(
            "pepsi_oldest_transaction_age_seconds",
            "Age of the oldest transaction holding back vacuum in the queue's database "
            "(0: none); dead rows pile up behind it",
            value=0.0 if holder is None else holder.age_s,
        ),
        GaugeMetricFamily(
            "pepsi_oldest_transaction_pid",
            "Backend pid of that transaction (0: none, or a prepared transaction)",
            value=0 if holder is None or holder.pid is None else holder.pid,
        ),
    ]


class _HorizonCollector(Collector):
    """Reads the horizon on the scrape thread, on a connection of the reader's own."""

    def __init__(self, read: Callable[[], Holder | None]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        try:
            return horizon_families(self.read())
        except DatabaseUnavailable as exc:
            log.warning("metrics: %s", exc)
            return []


class MetricsServer:
    """The HTTP endpoint; `close` stops it. With `horizon` (a `pepsi.admin.horizon.Probe`),
    a scrape also reports the oldest transaction holding back vacuum."""

    def __init__(
        self,
        address: tuple[str, int],
        snapshot: Callable[[], Snapshot],
        stages: Sequence[str],
        horizon: Callable[[], Holder | None] | None = None,
    ) -> None:
        self._horizon = horizon
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_LoopCollector(asyncio.get_running_loop(), snapshot, stages))
        if horizon is not None:
            registry.register(_HorizonCollector(horizon))
        host, port = address
        # OSError (address in use, not an address of this host) is the caller's to report
        self._server: Any
        self._server, self._thread = start_http_server(port, host, registry=registry)
        bound = self._server.server_address
        self.url = f"http://{host_port(str(bound[0]), bound[1])}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        close = getattr(self._horizon, "close", None)
        if close is not None:  # the probe's connection
            close()
