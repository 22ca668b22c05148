"""Live reconfiguration (P-10) with a real dispatcher and real workers, under load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import psycopg

from pepsi import Message, stage
from tests.scenarios.conftest import REPO, Pipeline, wait_until

RUNS_TABLE = (
    "CREATE TABLE reload_runs (workqueue_id bigint, version text,"
    " at timestamptz DEFAULT clock_timestamp())"
)
_connection: list[psycopg.Connection[Any]] = []


def _record(msg: Message, version: str) -> None:
    if not _connection:
        _connection.append(psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True))
    time.sleep(0.01)  # a stage that takes a moment: the reload lands under load
    _connection[0].execute(
        "INSERT INTO reload_runs (workqueue_id, version) VALUES (%s, %s)", (msg.id, version)
    )


@stage()
def v1(msg: Message) -> None:
    _record(msg, "v1")


@stage()
def v2(msg: Message) -> None:
    _record(msg, "v2")


BEFORE = """
[stage-a]
HANDLER = tests.scenarios.test_reload:v1
NEXT = b
[stage-b]
HANDLER = tests.stages:effect
[stage-gone]
HANDLER = tests.stages:effect
"""
AFTER = """
[stage-a]
HANDLER = tests.scenarios.test_reload:v2
NEXT = c
[stage-b]
HANDLER = tests.stages:effect
[stage-c]
HANDLER = tests.stages:effect
"""


def pepsi(pipeline: Pipeline, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pepsi", "-c", str(pipeline.conf), *args],
        env=pipeline.env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_stage_changed_added_and_removed_under_load(pipeline: Pipeline) -> None:
    pipeline.db.execute(RUNS_TABLE)
    pipeline.configure(BEFORE)
    ids = pipeline.publish("a", count=300)
    dispatcher = pipeline.start()
    wait_until(
        lambda: pipeline.scalar("SELECT count(*) FROM reload_runs") >= 20, what="v1 under way"
    )
    pipeline.conf.write_text(pipeline.conf.read_text().replace(BEFORE, AFTER))
    done = pepsi(pipeline, "config", "reload")
    assert done.returncode == 0, done.stderr
    wait_until(lambda: "configuration reloaded" in dispatcher.log, what="the reload")
    acknowledged = pipeline.scalar("SELECT clock_timestamp()")
    # Published to the stage just removed (this publisher still knows it): parked.
    parked = pipeline.publish("gone", count=3)
    wait_until(lambda: pipeline.remaining() == len(parked), timeout=90, what="the rest")
    assert "configuration reloaded: 3 stages (added c; removed gone; changed a)" in dispatcher.log
    # No message ran under the retired configuration once the reload was acknowledged.
    late_v1 = pipeline.scalar(
        "SELECT count(*) FROM reload_runs WHERE version = 'v1' AND at > %s", acknowledged
    )
    assert late_v1 == 0
    # Nothing lost: every message ran at `a` and went on, to b before, to c after.
    ran = {int(r[0]) for r in pipeline.db.execute("SELECT workqueue_id FROM reload_runs")}
    assert ran == set(ids)
    effects = pipeline.effects()
    assert {w for (w, s) in effects if s in ("b", "c")} == set(ids)
    assert any(s == "c" for (_, s) in effects)
    assert any(s == "b" for (_, s) in effects)
    # The removed stage's messages wait for it, untouched.
    assert pipeline.by_status() == {"pending": len(parked)}
    assert dispatcher.stop() == 0


def test_a_graph_that_does_not_parse_stops_the_dispatcher_with_78(pipeline: Pipeline) -> None:
    pipeline.db.execute(RUNS_TABLE)
    pipeline.configure(BEFORE)
    ids = pipeline.publish("a", count=100)
    dispatcher = pipeline.start()
    wait_until(
        lambda: pipeline.scalar("SELECT count(*) FROM reload_runs") >= 5, what="v1 under way"
    )
    pipeline.conf.write_text(pipeline.conf.read_text() + "[stage-broken]\nNEXT = nowhere\n")
    dispatcher.proc.send_signal(signal.SIGHUP)  # as `pepsi config reload`
    assert dispatcher.proc.wait(timeout=60) == 78
    assert "configuration reload failed:" in dispatcher.log
    # An orderly stop: nothing left running, nothing lost.
    assert pipeline.scalar("SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'") == 0
    left = {int(r[0]) for r in pipeline.db.execute("SELECT workqueue_id FROM pepsi.workqueue")}
    ran_through = {w for (w, s) in pipeline.effects() if s == "b"}
    assert left | ran_through >= set(ids)


def test_an_unreadable_overlay_keeps_the_stages_and_is_retried(pipeline: Pipeline) -> None:
    pipeline.configure("[stage-a]\nHANDLER = tests.stages:effect\n")
    dispatcher = pipeline.start()
    first = pipeline.publish("a")  # the publisher reads the overlay as it opens
    pipeline.db.execute("ALTER TABLE pepsi.config_override RENAME TO config_override_away")
    dispatcher.proc.send_signal(signal.SIGHUP)
    wait_until(
        lambda: "cannot read the configuration overlay" in dispatcher.log, what="the warning"
    )
    ids = pipeline.publish("a", count=5)  # the current stages keep running meanwhile
    wait_until(lambda: pipeline.remaining() == 0, what="the current stages to run")
    assert {w for (w, _) in pipeline.effects()} == set(first + ids)
    pipeline.db.execute("ALTER TABLE pepsi.config_override_away RENAME TO config_override")
    wait_until(lambda: "configuration reloaded" in dispatcher.log, what="the retried reload")
    assert dispatcher.stop() == 0


def test_config_set_adds_a_stage_live_and_refuses_what_would_not_load(
    pipeline: Pipeline,
) -> None:
    pipeline.configure("[stage-a]\nHANDLER = tests.stages:effect\n")
    dispatcher = pipeline.start()
    refused = pepsi(pipeline, "config", "set", "stage-a.PARALLELISM=many")
    assert refused.returncode == 1
    assert len(refused.stderr.strip().splitlines()) == 1
    assert "PARALLELISM" in refused.stderr
    assert pipeline.scalar("SELECT count(*) FROM pepsi.config_override") == 0
    done = pepsi(pipeline, "config", "set", "stage-extra.HANDLER=tests.stages:effect")
    assert done.returncode == 0, done.stderr
    wait_until(lambda: "added extra" in dispatcher.log, what="the new stage")
    ids = pipeline.publish("extra", count=5)
    wait_until(lambda: pipeline.remaining() == 0, what="the new stage to run")
    assert pipeline.effects() == {(i, "extra"): 1 for i in ids}
    done = pepsi(pipeline, "config", "unset", "stage-extra.HANDLER")
    assert done.returncode == 0, done.stderr
    wait_until(lambda: "removed extra" in dispatcher.log, what="the stage to go")
    assert dispatcher.stop() == 0
