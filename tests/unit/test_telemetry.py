"""Feature telemetry (P-11) without a database: the sink, the trace link, the counters, the file.

Spans and counters are captured with the SDK's in-memory exporter and
reader; the stage passes of a real worker are in
tests/integration/test_telemetry.py.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import pepsi
from pepsi import telemetry
from pepsi.admin.config.telemetry import rewrite, write_switch
from pepsi.config import Config, load_config
from pepsi.errors import ConfigError
from pepsi.publishing.message import OutgoingMessage
from pepsi.telemetry.otel import exporters

CONF = """\
[pepsi]
SHARE_TELEMETRY = {on}

[stage-route]
PROGRAM = pepsi-stage-if
IF = recipients ~ "secret-customer.example"
THEN = deliver
ELSE = deliver

[stage-deliver]
HANDLER = secret_company_module:deliver
MAX_LIFETIME = 2h
BOUNCE_STAGE = route
"""


def config_with(tmp_path: Path, on: bool) -> Config:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF.format(on="yes" if on else "no"))
    return load_config(path)


@pytest.fixture(autouse=True)
def no_process_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test installs its own sink; none leaks into the next."""
    monkeypatch.setattr(telemetry, "_process_sink", None)


# --- off -------------------------------------------------------------------------


def test_off_is_the_no_op_sink(tmp_path: Path) -> None:
    sink = telemetry.install(config_with(tmp_path, on=False))
    assert sink is telemetry.NO_SINK
    assert not sink.enabled
    items = [OutgoingMessage("route", b"x")]
    with sink.publish(items) as published:
        assert published is items  # nothing added to the messages
    with sink.stage_pass(1, "route", None) as outcome:
        outcome("finish")
    assert telemetry.for_publisher(config_with(tmp_path, on=False)) is telemetry.NO_SINK


def test_off_a_worker_and_a_publisher_import_no_opentelemetry(tmp_path: Path) -> None:
    config = tmp_path / "pepsi.conf"
    config.write_text(CONF.format(on="no"))
    code = f"""
import sys
from pathlib import Path
from pepsi.config import load_config
from pepsi.worker import runtime, runner
from pepsi.publishing import Publisher
from pepsi import telemetry
config = load_config(Path({str(config)!r}))
assert telemetry.install(config, config.stages["deliver"]) is telemetry.NO_SINK
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_on_without_the_package_warns_once_and_stays_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "pepsi.telemetry.otel", raising=False)
    monkeypatch.delattr(pepsi.telemetry, "otel", raising=False)  # imported afresh, and fails
    with caplog.at_level(logging.WARNING, logger="pepsi.telemetry"):
        sink = telemetry.install(config_with(tmp_path, on=True))
    assert sink is telemetry.NO_SINK
    assert len(caplog.records) == 1
    assert "install pepsi[telemetry]" in caplog.records[0].getMessage()


# --- on: spans and the trace link --------------------------------------------------


def test_a_pass_is_one_span_child_of_the_publish_span(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    config = config_with(tmp_path, on=True)
    sink = telemetry.install(config, span_exporter=exporter)
    assert sink.enabled
    assert telemetry.for_publisher(config) is sink  # publishers of this process share it
    items = [
        OutgoingMessage("route", b"body", properties={"k": "v"}),
        OutgoingMessage("route", b"body"),
    ]
    with sink.publish(items) as published:
        pass
    parents = [m.properties[telemetry.TRACEPARENT] for m in published]
    assert published[0].properties["k"] == "v"  # the producer's own properties are kept
    assert items[0].properties == {"k": "v"}  # and the caller's messages left alone
    with sink.stage_pass(41, "route", parents[0]) as outcome:
        outcome("advance")
    with sink.stage_pass(42, "deliver", "not a trace context") as outcome:
        outcome("finish")
    publish, first, orphan = exporter.get_finished_spans()
    assert publish.name == "pepsi publish"
    assert publish.attributes is not None
    assert publish.attributes["messaging.batch.message_count"] == 2
    assert first.name == "pepsi stage route"
    assert dict(first.attributes or {}) == {
        "messaging.system": "pepsi",
        "messaging.message.id": "41",
        "pepsi.stage": "route",
        "pepsi.outcome": "advance",
    }
    assert first.parent is not None
    assert publish.context is not None
    assert first.context is not None
    assert first.context.trace_id == publish.context.trace_id  # one trace: the journey
    assert first.parent.span_id == publish.context.span_id
    assert first.end_time is not None
    assert first.start_time is not None
    assert first.end_time >= first.start_time  # the duration is the span's own
    assert orphan.parent is None  # a property that is not a trace context: a trace of its own
    assert orphan.context is not None
    assert orphan.context.trace_id != publish.context.trace_id


def test_a_failing_pass_still_ends_its_span(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    sink = telemetry.install(config_with(tmp_path, on=True), span_exporter=exporter)
    with pytest.raises(RuntimeError), sink.stage_pass(7, "route", None):
        raise RuntimeError("the connection went")
    (span,) = exporter.get_finished_spans()
    assert span.status.is_ok is False


# --- feature counters -------------------------------------------------------------


def counters(reader: InMemoryMetricReader) -> dict[str, list[dict[str, Any]]]:
    data = reader.get_metrics_data()
    assert data is not None
    found: dict[str, list[dict[str, Any]]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points = found.setdefault(metric.name, [])
                for point in metric.data.data_points:
                    points.append(dict(point.attributes or {}))
    return found


@pytest.mark.parametrize(
    ("stage", "kind", "options"),
    [
        (
            "route",
            {"pepsi.stage.kind": "builtin", "pepsi.builtin": "if"},
            {"BUILTIN.CONDITION", "BUILTIN.THEN", "BUILTIN.OTHERWISE"},
        ),
        ("deliver", {"pepsi.stage.kind": "handler"}, {"MAX_LIFETIME", "BOUNCE_STAGE"}),
    ],
)
def test_feature_counters_name_kinds_and_options_never_content(
    tmp_path: Path, stage: str, kind: dict[str, str], options: set[str]
) -> None:
    reader = InMemoryMetricReader()
    config = config_with(tmp_path, on=True)
    telemetry.install(
        config, config.stages[stage], span_exporter=InMemorySpanExporter(), metric_reader=reader
    )
    found = counters(reader)
    assert found["pepsi.worker.starts"] == [kind]
    named = {p["pepsi.option"] for p in found["pepsi.stage.options"]}
    assert options <= named
    text = json.dumps(found)
    for secret in ("secret-customer", "secret_company_module", "2h", "7200", "recipients"):
        assert secret not in text  # values, conditions, handler modules: never sent


def test_feature_names_are_names(tmp_path: Path) -> None:
    config = config_with(tmp_path, on=True)
    kind, options = telemetry.features(config, config.stages["deliver"])
    assert kind == {"pepsi.stage.kind": "handler"}
    assert sorted(options) == ["BOUNCE_STAGE", "MAX_LIFETIME"]


# --- exporters from OTEL_* -------------------------------------------------------


def test_exporters_follow_the_otel_variables(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert exporters("traces") == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console,nonesuch")
    with caplog.at_level(logging.WARNING, logger="pepsi.telemetry"):
        (console,) = exporters("traces")
    assert isinstance(console, ConsoleSpanExporter)
    assert console.out is sys.stderr  # never a worker's stdout, its status channel
    assert "no exporter named nonesuch" in caplog.text


# --- the switch in the file --------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [
        # the line replaced, its indentation and line ending kept
        (
            "# top\n[pepsi]\nALLOW_FUSION = no\nshare_telemetry=no   # old\n\n[stage-a]\nX = 1\n",
            "# top\n[pepsi]\nALLOW_FUSION = no\nSHARE_TELEMETRY = yes\n\n[stage-a]\nX = 1\n",
        ),
        ("[pepsi]\r\n  SHARE_TELEMETRY : no\r\n", "[pepsi]\r\n  SHARE_TELEMETRY = yes\r\n"),
        # inserted after the section's last line, before the blank lines
        (
            "[pepsi]\nALLOW_FUSION = no\n\n# a\n[stage-a]\nSHARE_TELEMETRY = no\n",
            "[pepsi]\nALLOW_FUSION = no\nSHARE_TELEMETRY = yes\n\n# a\n[stage-a]\nSHARE_TELEMETRY = no\n",
        ),
        # no [pepsi]: one appended
        ("[stage-a]\nX = 1", "[stage-a]\nX = 1\n\n[pepsi]\nSHARE_TELEMETRY = yes\n"),
        ("", "[pepsi]\nSHARE_TELEMETRY = yes\n"),
        # [Pepsi] is not [pepsi] to the parser
        (
            "[Pepsi]\nSHARE_TELEMETRY = no\n",
            "[Pepsi]\nSHARE_TELEMETRY = no\n\n[pepsi]\nSHARE_TELEMETRY = yes\n",
        ),
    ],
)
def test_rewrite_changes_one_line(before: str, after: str) -> None:
    assert rewrite(before, on=True) == after
    assert rewrite(after, on=True) == after


def test_write_switch_keeps_the_rest_and_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF.format(on="no"))
    path.chmod(0o640)
    assert write_switch(path, True)
    assert path.read_text() == CONF.format(on="yes")
    assert path.stat().st_mode & 0o777 == 0o640
    assert not write_switch(path, True)  # already so: the file is left alone
    assert load_config(path).pepsi.share_telemetry
    assert [p.name for p in tmp_path.iterdir()] == ["pepsi.conf"]  # no temporary file left


def test_a_file_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    if Path("/proc/self/comm").exists():  # even root cannot create files there
        path = Path("/proc/self/comm")
    else:
        path = tmp_path / "ro" / "pepsi.conf"
        path.parent.mkdir()
        path.write_text("[pepsi]\n")
        path.chmod(0o444)
        path.parent.chmod(0o555)
    with pytest.raises(ConfigError, match=r"cannot write: .*the switch is unchanged"):
        write_switch(path, True)


def test_an_application_s_own_provider_gets_pepsi_s_spans(tmp_path: Path) -> None:
    """A producer that set up OpenTelemetry itself: the publish span goes with its others."""
    config = tmp_path / "pepsi.conf"
    config.write_text(CONF.format(on="yes"))
    code = f"""
from pathlib import Path
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pepsi import telemetry
from pepsi.config import load_config
from pepsi.publishing.message import OutgoingMessage
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
sink = telemetry.for_publisher(load_config(Path({str(config)!r})))
with trace.get_tracer("app").start_as_current_span("request"):
    with sink.publish([OutgoingMessage("route")]) as items:
        pass
request = next(s for s in exporter.get_finished_spans() if s.name == "request")
publish = next(s for s in exporter.get_finished_spans() if s.name == "pepsi publish")
assert publish.parent.span_id == request.context.span_id
print(items[0].properties["traceparent"].split("-")[1] == format(request.context.trace_id, "032x"))
"""
    env = {"OTEL_METRICS_EXPORTER": "none", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, env=env
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "True\n", "")
