"""The dispatcher's Prometheus endpoint, scraped over HTTP during a real run."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.scenarios.conftest import Pipeline, wait_until

STAGES = (
    "[stage-a]\nHANDLER = tests.stages:noop\nNEXT = b\n[stage-b]\nHANDLER = tests.stages:noop\n"
)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}":
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }  # fmt: skip


def test_scrape_counts_a_run_without_waiting_for_a_flush(pipeline: Pipeline) -> None:
    # STATS_INTERVAL far away and never idle-flushed before the scrape matters:
    # the endpoint reads the dispatcher's memory, not the stats tables.
    pipeline.configure(STAGES, METRICS_ADDRESS="127.0.0.1:0", STATS_INTERVAL="10m")
    dispatcher = pipeline.start()
    wait_until(lambda: "metrics at" in dispatcher.log, what="the metrics endpoint")
    match = re.search(r"metrics at (http://\S+)", dispatcher.log)
    assert match, dispatcher.log
    url = match.group(1)
    before = scrape(url)
    assert before["pepsi_stage_outcomes_total{outcome=finish,stage=b}"] == 0
    assert before["pepsi_workers{stage=a}"] == 0
    pipeline.publish("a", count=10)
    wait_until(
        lambda: scrape(url)["pepsi_stage_outcomes_total{outcome=finish,stage=b}"] == 10,
        what="ten finishes in the scrape",
    )
    got = scrape(url)
    assert got["pepsi_stage_outcomes_total{outcome=advance,stage=a}"] == 10
    assert got["pepsi_stage_passes_total{result=ok,stage=a}"] == 10
    assert got["pepsi_claimed_messages_total{}"] == 20
    assert got["pepsi_workers_started_total{}"] >= 2
    assert got["pepsi_wakeups_total{cause=worker}"] > 0  # status lines read together wake once
    assert got["pepsi_worker_limit{stage=a}"] >= 1
    assert got["pepsi_dispatcher_start_time_seconds{}"] > 0
    assert dispatcher.stop() == 0
    # stopped: nothing listens there any more
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_an_address_in_use_is_a_one_line_configuration_error(pipeline: Pipeline) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        pipeline.configure(STAGES, METRICS_ADDRESS=f"127.0.0.1:{port}")
        dispatcher = pipeline.start()
        assert dispatcher.proc.wait(timeout=30) == 1  # an error, as documented
    assert f"[pepsi-dispatch] METRICS_ADDRESS: cannot listen on 127.0.0.1:{port}" in dispatcher.log
    assert "Traceback" not in dispatcher.log
