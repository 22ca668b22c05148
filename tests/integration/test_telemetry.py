"""Feature telemetry (P-11) on a real database: spans of a worker's passes, the switch.

A `StageRunner` runs in-process with a sink on the SDK's in-memory exporter;
`pepsi telemetry on|off|status` runs through the CLI against the same
database, with a LISTEN connection to see its NOTIFY.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pepsi import telemetry
from pepsi.cli import main
from pepsi.config import Config, load_config
from pepsi.protocol import parse_status
from pepsi.publishing import Publisher
from pepsi.stage import Message, stage
from pepsi.worker.runner import StageRunner
from pepsi.worker.runtime import connect_worker
from tests.stages import noop

Conn = psycopg.Connection[tuple[Any, ...]]

CONF = """\
[pepsi]
SHARE_TELEMETRY = {on}

[stage-a]
HANDLER = tests.stages:noop
NEXT = b
[stage-b]
HANDLER = tests.stages:noop
"""


@stage()
def finish_odd(msg: Message) -> object:
    return msg.finish() if msg.properties.get("n", 0) % 2 else None


def write_config(tmp_path: Path, on: bool) -> Path:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF.format(on="yes" if on else "no"))
    return path


@pytest.fixture(autouse=True)
def no_process_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry, "_process_sink", None)


def publish(config: Config, dsn: str, count: int) -> list[int]:
    with Publisher.connect(config, dsn) as publisher:
        return [publisher.publish("a", b"hello", properties={"n": n}) for n in range(count)]


def claim(conn: Conn, ids: list[int]) -> None:
    """As the dispatcher's claim leaves them: running at their stage."""
    conn.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = ANY(%s)", (ids,)
    )


def run_pass(config: Config, dsn: str, ids: list[int], sink: telemetry.Sink) -> bytes:
    conn = connect_worker(dsn, "a", synchronous_commit=False)
    with conn:
        runner = StageRunner(config, config.stages["a"], finish_odd, conn, sink=sink)
        return runner.run_batch(ids)


def test_a_worker_reports_one_span_per_pass_in_the_publish_trace(
    tmp_path: Path, dsn: str, conn: Conn
) -> None:
    config = load_config(write_config(tmp_path, on=True))
    exporter = InMemorySpanExporter()
    sink = telemetry.install(config, config.stages["a"], span_exporter=exporter)
    ids = publish(config, dsn, 4)  # the publisher of this process reports to the same sink
    publishes = exporter.get_finished_spans()
    assert [s.name for s in publishes] == ["pepsi publish"] * 4
    exporter.clear()
    claim(conn, ids)
    out = run_pass(config, dsn, ids, sink)
    assert [parse_status(line).status for line in out.splitlines()] == [0] * 4
    spans = exporter.get_finished_spans()
    assert len(spans) == 4  # one per pass, none for the batch's own work
    by_id = {str(s.attributes["messaging.message.id"]): s for s in spans if s.attributes}
    assert sorted(by_id) == sorted(str(i) for i in ids)
    for n, (wid, published) in enumerate(zip(ids, publishes, strict=True)):
        span = by_id[str(wid)]
        assert span.attributes is not None
        assert span.attributes["pepsi.stage"] == "a"
        assert span.attributes["pepsi.outcome"] == ("finish" if n % 2 else "advance")
        assert span.parent is not None
        assert published.context is not None
        assert span.parent.span_id == published.context.span_id
        assert span.context is not None
        assert span.context.trace_id == published.context.trace_id


def test_off_nothing_is_added_to_messages_and_nothing_reported(
    tmp_path: Path, dsn: str, conn: Conn
) -> None:
    config = load_config(write_config(tmp_path, on=False))
    ids = publish(config, dsn, 2)
    rows = conn.execute(
        "SELECT properties FROM pepsi.workqueue WHERE workqueue_id = ANY(%s)", (ids,)
    ).fetchall()
    assert [r[0] for r in rows] == [{"n": 0}, {"n": 1}]  # no traceparent
    claim(conn, ids)
    sink = telemetry.install(config, config.stages["a"])
    assert sink is telemetry.NO_SINK
    out = run_pass(config, dsn, ids, sink)
    assert len(out.splitlines()) == 2


# --- pepsi telemetry on|off|status -------------------------------------------------


@pytest.fixture
def env(dsn: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("PEPSI_DSN", dsn)
    return dsn


def test_on_and_off_rewrite_the_file_and_notify(
    tmp_path: Path, env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, on=False)
    with psycopg.connect(env, autocommit=True) as listener:
        listener.execute("LISTEN telemetry_changed")
        assert main(["-c", str(path), "telemetry", "on"]) == 0
        assert path.read_text() == CONF.format(on="yes")
        assert [n.channel for n in listener.notifies(timeout=10, stop_after=1)] == [
            "telemetry_changed"
        ]
        out = capsys.readouterr().out
        assert out == f"SHARE_TELEMETRY = yes in {path}; the dispatcher replaces its workers\n"
        assert main(["-c", str(path), "telemetry", "off"]) == 0
        assert path.read_text() == CONF.format(on="no")
        assert len(list(listener.notifies(timeout=10, stop_after=1))) == 1
        assert main(["-c", str(path), "telemetry", "off"]) == 0  # already: told again all the same
        assert "(already)" in capsys.readouterr().out
        assert len(list(listener.notifies(timeout=10, stop_after=1))) == 1


def test_status_shows_the_file_and_the_live_workers(
    tmp_path: Path, env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, on=True)
    reporting = connect_worker(env, "a", synchronous_commit=False, telemetry=True)
    silent = connect_worker(env, "a", synchronous_commit=False, telemetry=False)
    other = connect_worker(env, "b", synchronous_commit=False, telemetry=True)
    # A stage's own connection, named after it through PGAPPNAME: not a worker.
    own = psycopg.connect(env, application_name="pepsi-worker:a")
    with reporting, silent, other, own:
        assert main(["-c", str(path), "telemetry", "status"]) == 0
        assert capsys.readouterr().out == (
            f"SHARE_TELEMETRY = yes in {path}\n"
            "live workers: 3, reporting telemetry: 2\n"
            "  a  1 of 2\n"
            "  b  1 of 1\n"
        )
    assert main(["-c", str(path), "telemetry", "status"]) == 0
    assert capsys.readouterr().out.endswith("live workers: 0, reporting telemetry: 0\n")


def test_without_a_file_on_is_refused_in_one_line(
    isolated_env: Path, env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["telemetry", "on"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "no configuration file to write SHARE_TELEMETRY in" in err
    assert list(isolated_env.iterdir()) == []


def test_no_database_the_file_is_set_and_the_user_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, on=False)
    path.write_text(path.read_text() + "[pepsi-postgres]\nCONNECT_TIMEOUT = 1s\n")
    monkeypatch.setenv("PEPSI_DSN", "host=127.0.0.1 port=1 dbname=nowhere")
    code = main(["-c", str(path), "telemetry", "on"])
    err = capsys.readouterr().err
    assert code != 0
    assert "Traceback" not in err
    assert "SHARE_TELEMETRY = yes" in path.read_text()
    assert "the dispatcher was NOT told" in err


def test_a_fused_stage_has_a_span_of_its_own(tmp_path: Path, dsn: str, conn: Conn) -> None:
    path = tmp_path / "pepsi.conf"
    path.write_text(
        "[pepsi]\nSHARE_TELEMETRY = yes\n"
        "[stage-a]\nHANDLER = tests.stages:noop\nNEXT = b\n"
        "[stage-b]\nHANDLER = tests.stages:noop\nFUSION = yes\n"
    )
    config = load_config(path)
    exporter = InMemorySpanExporter()
    sink = telemetry.install(config, config.stages["a"], span_exporter=exporter)
    ids = publish(config, dsn, 1)
    exporter.clear()
    claim(conn, ids)
    conn_w = connect_worker(dsn, "a", synchronous_commit=False)
    with conn_w:
        runner = StageRunner(config, config.stages["a"], noop, conn_w, sink=sink)
        (line,) = runner.run_batch(ids).splitlines()
    assert [p.stage for p in parse_status(line).report or ()] == ["a", "b"]  # fused
    spans = {s.attributes["pepsi.stage"]: s for s in exporter.get_finished_spans() if s.attributes}
    assert sorted(spans) == ["a", "b"]
    assert spans["b"].attributes is not None
    assert spans["b"].attributes["pepsi.outcome"] == "finish"
    assert spans["a"].attributes is not None
    assert spans["a"].attributes["pepsi.outcome"] == "advance"  # its own, not the chain's
    assert spans["b"].context is not None
    assert spans["a"].context is not None
    assert spans["b"].context.trace_id == spans["a"].context.trace_id
