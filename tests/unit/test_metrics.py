"""The Prometheus families built from a snapshot (no server, no database)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

from pepsi.admin.horizon import Holder
from pepsi.dispatch.services.metrics import Gauges, Snapshot, families, horizon_families
from pepsi.dispatch.stats import Counts


class Fixed(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def scrape(snapshot: Snapshot, stages: list[str]) -> dict[str, float]:
    """Render as a scrape would, parse back: {'name{label=value,...}': value}."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed(families(snapshot, stages)))
    text = generate_latest(registry).decode()
    return {
        sample.name
        + "{"
        + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
        + "}": sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_counters_and_gauges_have_conventional_names() -> None:
    counts = Counts(
        stages={"a": Counter(processed=5, failed=1, advanced=4, retries=1, busy_us=2_500_000)},
        dispatch=Counter(claims=3, claimed=7, wakeups_notify=2, backpressure_events=1),
    )
    gauges = Gauges(workers={"a": 2}, in_flight={"a": 3}, worker_limit={"a": 4}, started=1e9)
    got = scrape(Snapshot(counts, gauges), ["a", "b"])
    assert got["pepsi_stage_passes_total{result=ok,stage=a}"] == 5
    assert got["pepsi_stage_passes_total{result=failed,stage=a}"] == 1
    assert got["pepsi_stage_outcomes_total{outcome=advance,stage=a}"] == 4
    assert got["pepsi_stage_outcomes_total{outcome=retry,stage=a}"] == 1
    assert got["pepsi_stage_worker_seconds_total{stage=a}"] == 2.5
    assert got["pepsi_claims_total{}"] == 3
    assert got["pepsi_claimed_messages_total{}"] == 7
    assert got["pepsi_backpressure_events_total{}"] == 1
    assert got["pepsi_wakeups_total{cause=notify}"] == 2
    assert got["pepsi_wakeups_total{cause=poll}"] == 0
    assert got["pepsi_workers{stage=a}"] == 2
    assert got["pepsi_in_flight_messages{stage=a}"] == 3
    assert got["pepsi_worker_limit{stage=a}"] == 4
    assert got["pepsi_dispatcher_start_time_seconds{}"] == 1e9
    # a configured stage that has done nothing yet still has its series, at zero
    assert got["pepsi_stage_strikes_total{stage=b}"] == 0
    assert got["pepsi_workers{stage=b}"] == 0


def test_oldest_transaction_gauges() -> None:
    """The age and the holder's pid as values, never a label (a series per session)."""

    def read(holder: Holder | None) -> dict[str, float]:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(Fixed(horizon_families(holder)))
        text = generate_latest(registry).decode()
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        assert all(not s.labels for s in samples)
        return {s.name: s.value for s in samples}

    held = Holder("session", 192.5, pid=1234, user="x", state="idle in transaction")
    assert read(held) == {
        "pepsi_oldest_transaction_age_seconds": 192.5,
        "pepsi_oldest_transaction_pid": 1234,
    }
    assert read(None) == {
        "pepsi_oldest_transaction_age_seconds": 0,
        "pepsi_oldest_transaction_pid": 0,
    }
    prepared = Holder("prepared", 10.0, user="x", gid="t1")
    assert read(prepared)["pepsi_oldest_transaction_pid"] == 0
