"""The telemetry switch under load (P-11): real dispatcher, real workers, spans to a file.

The workers export through `tests/programs/otel_export` (an exporter found by
OTEL_TRACES_EXPORTER like any installed one), one JSON line per span. While a
producer keeps the stages busy, `pepsi telemetry on` and then `off` run: the
dispatcher retires its workers, their replacements report (or stop
reporting), and every message is still processed exactly once per stage.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pepsi import telemetry
from pepsi.admin.config.telemetry import live_workers
from pepsi.cli import main
from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher
from tests.scenarios.conftest import REPO, Pipeline, wait_until

EXPORTER_DIR = REPO / "tests" / "programs" / "otel_export"
STAGES = """
[pepsi]
SHARE_TELEMETRY = no

[stage-a]
HANDLER = tests.stages:effect
NEXT = b
PARALLELISM = 2
QUEUE_LIMIT = 8
[stage-b]
HANDLER = tests.stages:effect
PARALLELISM = 2
QUEUE_LIMIT = 8
"""
BACKLOG = 200  # the producer tops the queue up to this many rows


class Producer(threading.Thread):
    """Keeps the stages busy: publishes small batches whenever the queue runs low."""

    def __init__(self, conf: Path, dsn: str) -> None:
        super().__init__(daemon=True)
        self.publisher = Publisher.connect(load_config(conf), dsn)  # read while the file says no
        self.dsn = dsn
        self.ids: list[int] = []
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as db:
                while not self.stopping.is_set():
                    row = db.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
                    if row is not None and int(row[0]) >= BACKLOG:
                        self.stopping.wait(0.02)  # poll the backlog, not a guess at timing
                        continue
                    self.ids += self.publisher.publish_many([OutgoingMessage("a")] * 20)
        except BaseException as exc:  # noqa: BLE001  # reported by the test, not lost in a thread
            self.error = exc
        finally:
            self.publisher.close()

    def stop(self) -> list[int]:
        self.stopping.set()
        self.join(timeout=30)
        assert self.error is None, self.error
        return self.ids


def spans(path: Path) -> list[dict[str, Any]]:
    """The spans written so far: live workers append to the file, so the last line may
    still be half written (only lines ending in a newline are complete)."""
    if not path.exists():
        return []
    complete = path.read_text().rpartition("\n")[0]
    return [json.loads(line) for line in complete.splitlines()]


def workers(pipeline: Pipeline) -> tuple[int, int]:
    """(live, reporting) over every stage."""
    stages = live_workers(pipeline.db)
    return sum(s.live for s in stages), sum(s.reporting for s in stages)


@pytest.fixture
def traced_pipeline(
    pipeline: Pipeline, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Pipeline, Path]:
    out = tmp_path / "spans.jsonl"
    pipeline.extra_env = {
        "PYTHONPATH": f"{REPO}:{EXPORTER_DIR}",
        "OTEL_TRACES_EXPORTER": "pepsi_test_file",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: spans reach the file while the test waits
        "PEPSI_TEST_SPANS": str(out),
    }
    monkeypatch.setenv("PEPSI_DSN", pipeline.dsn)  # for `pepsi telemetry` run in-process
    monkeypatch.setattr(telemetry, "_process_sink", None)
    return pipeline, out


def test_toggling_under_load_changes_what_new_workers_report_and_loses_nothing(
    traced_pipeline: tuple[Pipeline, Path],
) -> None:
    pipeline, out = traced_pipeline
    pipeline.configure(STAGES)
    dispatcher = pipeline.start()
    producer = Producer(pipeline.conf, pipeline.dsn)
    producer.start()
    wait_until(lambda: pipeline.scalar("SELECT count(*) FROM test_effects") > 100, what="load")
    assert workers(pipeline)[1] == 0  # off: no worker reports

    toggled = pipeline.scalar("SELECT clock_timestamp()")
    assert main(["-c", str(pipeline.conf), "telemetry", "on"]) == 0
    wait_until(
        lambda: (w := workers(pipeline))[0] > 0 and w[0] == w[1],
        timeout=60,
        what="every live worker reporting",
    )

    # Published now, with the publish span's context: each journey is one trace.
    publish_spans = InMemorySpanExporter()
    on = load_config(pipeline.conf)
    telemetry.install(on, span_exporter=publish_spans)
    with Publisher.connect(on, pipeline.dsn) as publisher:
        traced = [publisher.publish("a") for _ in range(40)]
    wait_until(
        lambda: (
            {(s["message_id"], s["stage"]) for s in spans(out)}
            >= {(str(i), st) for i in traced for st in ("a", "b")}
        ),
        timeout=60,
        what="a span for each traced message at each stage",
    )

    assert main(["-c", str(pipeline.conf), "telemetry", "off"]) == 0
    wait_until(
        lambda: (w := workers(pipeline))[0] > 0 and w[1] == 0,
        timeout=60,
        what="no live worker reporting",
    )
    off = load_config(pipeline.conf)
    assert not off.pepsi.share_telemetry
    with Publisher.connect(off, pipeline.dsn) as publisher:
        untraced = publisher.publish_many([OutgoingMessage("a")] * 40)

    loaded = producer.stop()
    wait_until(pipeline.settled, timeout=120, what="the queue to drain")
    assert dispatcher.stop() == 0

    # Nothing lost, nothing twice.
    every = loaded + traced + untraced
    assert pipeline.effects() == {(i, s): 1 for i in every for s in ("a", "b")}
    log = dispatcher.log
    assert "Traceback" not in log
    assert "telemetry switch changed" in log

    reported = spans(out)
    # The workers that ran before the switch reported nothing, ever.
    before = {
        int(r[0])
        for r in pipeline.db.execute(
            "SELECT DISTINCT pid FROM test_effects WHERE at < %s", (toggled,)
        ).fetchall()
    }
    assert before
    assert not {s["pid"] for s in reported} & before
    # A message published with telemetry off has no span after the switch went off.
    assert not {s["message_id"] for s in reported} & {str(i) for i in untraced}
    # The traced ones: one span per stage, children of their own publish span.
    publishes = publish_spans.get_finished_spans()
    assert len(publishes) == len(traced)
    by_message = {}
    for publish_span, wid in zip(publishes, traced, strict=True):
        assert publish_span.context is not None
        by_message[str(wid)] = (publish_span.context.trace_id, publish_span.context.span_id)
    linked = [s for s in reported if s["message_id"] in by_message]
    assert len(linked) == 2 * len(traced)  # one per stage pass, none twice
    for span in linked:
        assert (span["trace_id"], span["parent_id"]) == by_message[span["message_id"]]
        assert span["outcome"] == ("advance" if span["stage"] == "a" else "finish")
    # The producer's messages (no trace context) were reported too, in traces of their own.
    assert any(s["message_id"] in {str(i) for i in loaded} for s in reported)
