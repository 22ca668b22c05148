"""The pipeline end to end: real dispatcher, real worker processes (issue 3)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.scenarios.conftest import REPO, Pipeline, wait_until

THREE_STAGES = """
[stage-a]
HANDLER = tests.stages:effect
NEXT = b
PARALLELISM = 3
QUEUE_LIMIT = 4
[stage-b]
HANDLER = tests.stages:effect
NEXT = c
PARALLELISM = 2
QUEUE_LIMIT = 8
[stage-c]
HANDLER = tests.stages:effect
PARALLELISM = 3
QUEUE_LIMIT = 2
"""


def effects_per_message(pipeline: Pipeline) -> dict[tuple[int, str], int]:
    rows = pipeline.db.execute(
        "SELECT workqueue_id, stage, count(*) FROM test_effects GROUP BY 1, 2"
    ).fetchall()
    return {(int(w), str(s)): int(n) for w, s, n in rows}


def test_three_stages_every_message_exactly_once(pipeline: Pipeline) -> None:
    pipeline.configure(THREE_STAGES)
    ids = pipeline.publish("a", count=1200, sender="shop@example.org", recipients=["x@y.z"])
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.remaining() == 0, timeout=120, what="the queue to drain")
    assert dispatcher.stop() == 0
    effects = effects_per_message(pipeline)
    expected = {(i, s): 1 for i in ids for s in ("a", "b", "c")}
    assert effects == expected
    assert "3600 answers from workers and consumers" in dispatcher.log, dispatcher.log
    # A claim beyond one per message per stage is a row given back unrun (a worker
    # retired or capacity shrank while the claim ran) and is counted as requeued.
    claimed = int(dispatcher.log.split("stopped: since start, ")[1].split(" rows claimed")[0])
    requeued = pipeline.scalar("SELECT coalesce(sum(requeued), 0) FROM pepsi.stage_stats")
    assert claimed - 3600 == requeued, dispatcher.log


def test_state_travels_and_bodies_are_read(pipeline: Pipeline) -> None:
    pipeline.configure(
        "[stage-count]\nHANDLER = tests.stages:count\nNEXT = body\n"
        "[stage-body]\nHANDLER = tests.stages:reverse_body_len\nNEXT = park\n"
        "[stage-park]\nHANDLER = tests.stages:park\n"
    )
    (wid,) = pipeline.publish("count", body=b"hello world")
    pipeline.start()
    wait_until(
        lambda: pipeline.scalar("SELECT status::text FROM pepsi.workqueue") == "paused",
        what="the message to park",
    )
    state = pipeline.scalar("SELECT state FROM pepsi.workqueue WHERE workqueue_id = %s", wid)
    assert state["passes"] == 1
    assert state["stages"] == ["count"]
    assert state["body_length"] == 11
    assert state["pause_reason"] == "parked by test"


def test_external_program_stage(pipeline: Pipeline, tmp_path: Path) -> None:
    program = tmp_path / "example-worker"
    program.write_text(
        f'#!/bin/sh\nexec {sys.executable} {REPO / "examples" / "protocol_worker.py"} "$@"\n'
    )
    program.chmod(0o755)
    pipeline.configure(
        "[stage-first]\nHANDLER = tests.stages:noop\nNEXT = external\n"
        f"[stage-external]\nPROGRAM = {program}\nNEXT = last\nQUEUE_LIMIT = 8\n"
        "[stage-last]\nHANDLER = tests.stages:effect\n"
    )
    ids = pipeline.publish("first", count=300)
    dispatcher = pipeline.start()
    # PGAPPNAME names the program's connection after its stage, as `pepsi top` counts them
    wait_until(lambda: pipeline.workers("external") >= 1, what="the program's connection")
    wait_until(lambda: pipeline.remaining() == 0, timeout=60, what="the queue to drain")
    assert dispatcher.stop() == 0
    assert effects_per_message(pipeline) == {(i, "last"): 1 for i in ids}


def test_second_dispatcher_is_refused(pipeline: Pipeline) -> None:
    pipeline.configure("[stage-a]\nHANDLER = tests.stages:noop\n", LOCK_WAIT="1500ms")
    first = pipeline.start()
    started = time.monotonic()
    second = subprocess.run(
        [sys.executable, "-m", "pepsi", "-c", str(pipeline.conf), "dispatch", "serve"],
        env=pipeline.env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    waited = time.monotonic() - started
    assert second.returncode == 1
    assert "another dispatcher is running on this database (backend pid" in second.stderr
    assert "pepsi-dispatch" in second.stderr
    assert waited >= 1.5  # LOCK_WAIT
    assert first.proc.poll() is None  # the first one is untouched
    assert first.stop() == 0


def test_leftover_running_rows_are_reset_at_start(pipeline: Pipeline) -> None:
    pipeline.configure("[stage-a]\nHANDLER = tests.stages:effect\n")
    ids = pipeline.publish("a", count=20)
    pipeline.db.execute("UPDATE pepsi.workqueue SET status = 'running'")
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.remaining() == 0, what="the reset rows to finish")
    assert "reset 20 leftover running rows to pending" in dispatcher.log
    assert effects_per_message(pipeline) == {(i, "a"): 1 for i in ids}
    assert dispatcher.stop() == 0


def test_sigterm_mid_run_requeues_and_a_restart_finishes(pipeline: Pipeline) -> None:
    pipeline.configure(
        "[stage-slow]\nHANDLER = tests.stages:slow\nNEXT = done\nPARALLELISM = 2\n"
        "[stage-done]\nHANDLER = tests.stages:effect\n"
    )
    ids = pipeline.publish("slow", count=200, properties={"sleep": 0.02})
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.scalar("SELECT count(*) FROM test_effects") >= 20, what="progress")
    assert dispatcher.stop(signal.SIGTERM) == 0
    assert pipeline.by_status().get("running", 0) == 0
    # a session leaves pg_stat_activity when its server process ends, after the worker
    wait_until(lambda: pipeline.workers() == 0, timeout=10, what="the workers' sessions to end")
    assert pipeline.remaining() > 0
    again = pipeline.start()
    wait_until(lambda: pipeline.remaining() == 0, timeout=60, what="the rest to finish")
    assert again.stop(signal.SIGINT) == 0
    effects = effects_per_message(pipeline)
    assert set(effects) == {(i, "done") for i in ids}  # every message finished


def test_pools_grow_on_demand_and_shrink_to_zero(pipeline: Pipeline) -> None:
    pipeline.configure(
        "[pepsi-dispatch]\nPOLL_INTERVAL = 1s\nWORKER_IDLE_TIMEOUT = 300ms\n"
        "[stage-a]\nHANDLER = tests.stages:slow\nPARALLELISM = 3\nQUEUE_LIMIT = 2\n"
        "[stage-idle]\nHANDLER = tests.stages:noop\n"
    )
    dispatcher = pipeline.start()
    assert pipeline.workers() == 0  # an idle pipeline starts no worker at all
    pipeline.publish("a", count=60, properties={"sleep": 0.05})
    wait_until(lambda: pipeline.workers("a") == 3, what="the pool to grow to PARALLELISM")
    assert pipeline.workers("idle") == 0
    wait_until(lambda: pipeline.remaining() == 0, what="the queue to drain")
    wait_until(lambda: pipeline.workers() == 0, timeout=10, what="the pool to shrink to zero")
    assert dispatcher.stop() == 0


def test_workers_are_recycled_after_max_messages(pipeline: Pipeline) -> None:
    pipeline.configure(
        "[stage-a]\nHANDLER = tests.stages:effect\nPARALLELISM = 2\nQUEUE_LIMIT = 4\n"
        "MAX_MESSAGES = 10\n"
    )
    ids = pipeline.publish("a", count=100)
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.remaining() == 0, timeout=60, what="the queue to drain")
    assert dispatcher.stop() == 0
    per_pid = pipeline.db.execute("SELECT pid, count(*) FROM test_effects GROUP BY pid").fetchall()
    assert max(int(n) for _, n in per_pid) <= 10
    assert len(per_pid) >= 10
    assert effects_per_message(pipeline) == {(i, "a"): 1 for i in ids}


def test_worker_refusing_to_start_loses_nothing(pipeline: Pipeline) -> None:
    pipeline.configure("[stage-a]\nHANDLER = tests.stages:does_not_exist\n")
    ids = pipeline.publish("a", count=5)
    dispatcher = pipeline.start()
    wait_until(lambda: "refused to run" in dispatcher.log, what="the worker to refuse")
    assert "tests.stages has no does_not_exist" in dispatcher.log
    assert dispatcher.stop() == 0
    assert pipeline.by_status() == {"pending": len(ids)}


def test_unreadable_status_tears_the_worker_down(pipeline: Pipeline, tmp_path: Path) -> None:
    program = tmp_path / "garbling-worker"
    marker = tmp_path / "garbled-once"
    script = REPO / "tests" / "programs" / "garbling_worker.py"
    program.write_text(f"#!/bin/sh\nexec {sys.executable} {script} {marker}\n")
    program.chmod(0o755)
    pipeline.configure(f"[stage-x]\nPROGRAM = {program}\nQUEUE_LIMIT = 4\nPARALLELISM = 1\n")
    pipeline.publish("x", count=12)
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.remaining() == 0, timeout=30, what="the queue to drain")
    assert marker.exists()
    assert "unreadable status line" in dispatcher.log
    assert "strike 1" in dispatcher.log  # the head message was charged, the rest requeued
    assert dispatcher.stop() == 0


def test_non_json_state_never_crashes_the_worker(pipeline: Pipeline) -> None:
    pipeline.configure(
        "[stage-x]\nHANDLER = tests.stages:bad_state_then_fail\n"
        "[stage-y]\nHANDLER = tests.stages:bad_state\n"
        "[stage-z]\nHANDLER = tests.stages:bad_state_then_error\n"
    )
    (x,) = pipeline.publish("x")
    (y,) = pipeline.publish("y")
    (z,) = pipeline.publish("z")
    dispatcher = pipeline.start()
    wait_until(
        lambda: (
            pipeline.scalar(
                "SELECT count(*) FROM pepsi.workqueue WHERE status IN ('failed', 'paused')"
            )
            == 3
        ),
        what="the three messages to settle",
    )
    assert dispatcher.stop() == 0
    x_state = pipeline.scalar("SELECT state FROM pepsi.workqueue WHERE workqueue_id = %s", x)
    assert x_state["failure_class"] == "permanent"
    assert x_state["last_error"] == "and then it fails"
    y_row = pipeline.db.execute(
        "SELECT status::text, state FROM pepsi.workqueue WHERE workqueue_id = %s", (y,)
    ).fetchone()
    assert y_row is not None
    assert y_row[0] == "paused"  # a host failure: retried later
    assert "state is not JSON" in y_row[1]["last_error"]
    z_state = pipeline.scalar("SELECT state FROM pepsi.workqueue WHERE workqueue_id = %s", z)
    assert z_state["last_error"] == "RuntimeError: and then it breaks"
    assert "oops" not in z_state
    assert "died" not in dispatcher.log
    assert "in flight; requeued" not in dispatcher.log


def test_broken_handler_module_is_refused_in_one_line(pipeline: Pipeline, tmp_path: Path) -> None:
    (tmp_path / "broken_stage.py").write_text("raise RuntimeError('bad module')\n")
    pipeline.configure("[stage-a]\nHANDLER = broken_stage:run\n")
    pipeline.publish("a")
    dispatcher = pipeline.start()
    wait_until(lambda: "refused to run" in dispatcher.log, what="the worker to refuse")
    assert "importing broken_stage failed: RuntimeError: bad module" in dispatcher.log
    assert "Traceback" not in dispatcher.log
    assert dispatcher.stop() == 0
    assert pipeline.by_status() == {"pending": 1}


def test_dispatcher_dead_letters_expired_messages(pipeline: Pipeline) -> None:
    pipeline.configure(
        "[stage-stuck]\nHANDLER = tests.stages:does_not_exist\nTTL = 1s\nBOUNCE_STAGE = dlq\n"
        "[stage-dlq]\nHANDLER = tests.stages:effect\n"
    )
    ids = pipeline.publish("stuck", count=5)  # never processed: its worker refuses to start
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.remaining() == 0, timeout=30, what="expiry and dead-lettering")
    swept = re.findall(r"dead-lettered (\d+) expired messages \(TTL\)", dispatcher.log)
    assert sum(int(n) for n in swept) == 5  # one sweep, or more if a row was claimed
    assert effects_per_message(pipeline) == {(i, "dlq"): 1 for i in ids}
    assert dispatcher.stop() == 0


def test_repairs_with_the_dispatcher_running(pipeline: Pipeline) -> None:
    pipeline.configure("[stage-work]\nHANDLER = tests.stages:effect\n")
    dispatcher = pipeline.start()
    rows = pipeline.db.execute(
        "INSERT INTO pepsi.workqueue (stage, status, timeout, state) VALUES"
        " ('work', 'paused', now() + interval '1 hour', '{}'),"
        " ('work', 'failed', NULL, '{\"failed_stage\": \"work\", \"strikes\": 3}')"
        " RETURNING workqueue_id"
    ).fetchall()
    paused, failed = (int(r[0]) for r in rows)
    queue = [sys.executable, "-m", "pepsi", "-c", str(pipeline.conf), "queue"]
    for action in ("resume", "retry"):
        done = subprocess.run(
            [*queue, action, "--stage", "work"], env=pipeline.env(), cwd=REPO,
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    wait_until(lambda: pipeline.remaining() == 0, what="the repaired messages to run")
    assert dispatcher.stop() == 0
    assert effects_per_message(pipeline) == {(paused, "work"): 1, (failed, "work"): 1}


def test_the_dispatcher_vacuums_the_queue_at_the_pace_of_its_traffic(pipeline: Pipeline) -> None:
    pipeline.configure("[stage-a]\nHANDLER = tests.stages:noop\n", VACUUM_AFTER="100")

    def vacuums() -> int:
        pipeline.db.execute("SELECT pg_stat_clear_snapshot()")
        return int(
            pipeline.scalar(
                "SELECT vacuum_count FROM pg_stat_user_tables"
                " WHERE relid = 'pepsi.workqueue'::regclass"
            )
        )

    dispatcher = pipeline.start("-L", "debug")
    before = vacuums()
    # One run at a time, in the background: a run due while one runs starts at the next
    # cycle after it, and no cycle comes once the queue is idle. So each burst waits for
    # the previous run to end; 150 passes then make the next one due, whatever the pace.
    for burst in range(1, 4):
        pipeline.publish("a", count=150)
        wait_until(lambda: pipeline.remaining() == 0, what="the queue to drain")
        wait_until(
            lambda: dispatcher.log.count("vacuumed the queue tables") >= burst,  # noqa: B023
            what=f"the dispatcher's vacuum after burst {burst}",
        )
    # PostgreSQL counts them (a run that found autovacuum on the table skips it)
    wait_until(lambda: vacuums() > before, what="vacuum_count to grow")
    assert dispatcher.stop() == 0
    assert "vacuum of the queue tables failed" not in dispatcher.log


def test_a_slow_stage_spreads_over_its_pool_with_the_default_queue_limit(
    pipeline: Pipeline,
) -> None:
    """QUEUE_LIMIT is 512, but a stage taking 200 ms a message gets a window of one."""
    pipeline.configure("[stage-slow]\nHANDLER = tests.stages:faulty_serial\n")
    ids = pipeline.publish("slow", count=24, properties={"fault": "slow", "sleep": 0.2})
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.remaining() == 0, timeout=60, what="the queue to drain")
    assert dispatcher.stop() == 0
    assert set(pipeline.effects()) == {(i, "slow") for i in ids}
    pids = pipeline.scalar("SELECT count(DISTINCT pid) FROM test_effects")
    assert pids >= 3  # the default PARALLELISM of 4 is used, not one worker's queue


def test_a_stage_defined_only_in_the_overlay_is_dispatched(pipeline: Pipeline) -> None:
    pipeline.configure("[stage-a]\nHANDLER = tests.stages:noop\n")
    pipeline.db.execute(
        "INSERT INTO pepsi.config_override (section, key, value)"
        " VALUES ('stage-extra', 'HANDLER', 'tests.stages:effect')"
    )
    ids = pipeline.publish("extra", count=5)  # the publisher reads the overlay too
    dispatcher = pipeline.start()
    assert "dispatching 2 stages: a, extra" in dispatcher.log
    wait_until(lambda: pipeline.remaining() == 0, what="the overlay stage to drain")
    assert effects_per_message(pipeline) == {(i, "extra"): 1 for i in ids}
    assert dispatcher.stop() == 0


def test_pepsi_queue_tells_started_messages_from_those_read_ahead(pipeline: Pipeline) -> None:
    """Issue 33: the claim sets a row `running` when it goes into a worker's queue; the
    worker starts it later. `pepsi queue` shows the ones not started as `claimed`, from
    the dispatcher's live snapshot (which names each worker's head)."""
    pipeline.configure("[stage-slow]\nHANDLER = tests.stages:slow\nPARALLELISM = 1\n")
    dispatcher = pipeline.start()
    ids = pipeline.publish("slow", count=6, properties={"sleep": 3})
    wait_until(
        lambda: (
            pipeline.scalar("SELECT count(*) FROM pepsi.workqueue WHERE status = 'running'") >= 2
        ),
        what="a worker to hold more than one message",
    )
    queue = [sys.executable, "-m", "pepsi", "-c", str(pipeline.conf), "queue"]

    def run(*args: str) -> Any:
        done = subprocess.run(
            [*queue, *args, "--json"], env=pipeline.env(), cwd=REPO,
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    # Each listing reads the rows, then waits for the next live snapshot: the worker may
    # not have started its first message yet, or may move on to the next in between. A
    # listing made while it works on one shows that one running and the rest claimed.
    def listing() -> bool:
        listed = {item["id"]: item["status"] for item in run("list", "--stage", "slow")}
        held = [listed[i] for i in ids if listed.get(i) in ("running", "claimed")]
        return len(held) >= 2 and held == ["running"] + ["claimed"] * (len(held) - 1)

    wait_until(listing, what="the oldest held message running, the others claimed")

    def counted() -> dict[str, int] | None:
        (stage,) = run("status")["stages"]
        return stage if stage["running"] == 1 and stage.get("claimed", 0) >= 1 else None

    wait_until(counted, what="a status with one message running and some claimed")
    assert dispatcher.stop() == 0
