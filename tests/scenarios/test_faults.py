"""Every fault ends in a defined state (issue 5): real dispatcher, real processes.

Timings are shortened through the configuration (see Pipeline.configure):
strikes pause 300 ms then 600 ms, a lost database pauses 1 s, a stage cools
down 500 ms. Each scenario checks the exact final state of the faulty message
and that every other message finished exactly once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.scenarios.conftest import REPO, Pipeline, wait_until

FAULTY = "[stage-work]\nHANDLER = tests.stages:faulty\nPARALLELISM = 2\nQUEUE_LIMIT = 4\n"
SERIAL = FAULTY.replace("tests.stages:faulty", "tests.stages:faulty_serial")


def worker_pids(dispatcher_pid: int) -> list[int]:
    try:
        children = psutil.Process(dispatcher_pid).children()
    except psutil.NoSuchProcess:
        return []
    return [c.pid for c in children if "worker" in " ".join(c.cmdline())]


def finished_once(pipeline: Pipeline, ids: list[int], stage: str = "work") -> None:
    assert all(pipeline.row(i) is None for i in ids)
    effects = pipeline.effects()
    assert all(effects.get((i, stage)) == 1 for i in ids), effects


def finished_at_least_once(pipeline: Pipeline, ids: list[int]) -> None:
    """Batched stages write outcomes per batch: batch-mates of a crash run again."""
    assert all(pipeline.row(i) is None for i in ids)
    effects = pipeline.effects()
    assert all(effects.get((i, "work"), 0) >= 1 for i in ids), effects


def test_kill_9_a_worker_mid_batch(pipeline: Pipeline) -> None:
    pipeline.configure(FAULTY)
    ids = pipeline.publish("work", count=30, properties={"fault": "slow", "sleep": 0.1})
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.scalar("SELECT count(*) FROM test_effects") >= 3, what="progress")
    victim = wait_until(lambda: worker_pids(dispatcher.proc.pid), what="a worker")[0]
    os.kill(victim, signal.SIGKILL)
    wait_until(pipeline.settled, timeout=60, what="every message to finish")
    assert dispatcher.stop() == 0
    assert all(pipeline.row(i) is None for i in ids)
    effects = pipeline.effects()
    assert set(effects) == {(i, "work") for i in ids}
    # at least once: the messages the killed worker had already run in its
    # batch (at most QUEUE_LIMIT) may run again; nobody was failed for it
    assert sum(effects.values()) - len(ids) <= 4
    assert "killed by signal 9 holding" in dispatcher.log


@pytest.mark.parametrize("stage_config", [SERIAL, FAULTY], ids=["serial", "batched"])
def test_poison_message_fails_after_three_strikes_siblings_unharmed(
    pipeline: Pipeline, stage_config: str
) -> None:
    pipeline.configure(stage_config)
    before = pipeline.publish("work", count=10)
    (poison,) = pipeline.publish("work", properties={"fault": "crash"})
    after = pipeline.publish("work", count=10)
    dispatcher = pipeline.start()
    wait_until(pipeline.settled, timeout=60, what="the poison message to be failed")
    assert dispatcher.stop() == 0
    stage, status, state = pipeline.row(poison) or ("", "", {})
    assert (stage, status) == ("work", "failed")
    assert state["strikes"] == 3
    assert state["failure_class"] == "crashed"
    assert state["failed_stage"] == "work"
    assert "exited with status 3" in state["last_error"]
    if stage_config == SERIAL:
        finished_once(pipeline, before + after)
    else:
        finished_at_least_once(pipeline, before + after)


def test_hang_past_max_runtime_ends_in_timeout(pipeline: Pipeline) -> None:
    pipeline.configure(SERIAL + "MAX_RUNTIME = 700ms\n")
    (hung,) = pipeline.publish("work", properties={"fault": "hang"})
    others = pipeline.publish("work", count=10)
    dispatcher = pipeline.start()
    wait_until(pipeline.settled, timeout=60, what="the hung message to time out")
    assert dispatcher.stop() == 0
    stage, status, state = pipeline.row(hung) or ("", "", {})
    assert (stage, status) == ("work", "timeout")
    assert state["strikes"] == 3
    assert state["failure_class"] == "timed-out"
    assert "MAX_RUNTIME" in state["last_error"]
    finished_once(pipeline, others)


def test_host_failure_then_success(pipeline: Pipeline) -> None:
    pipeline.configure(FAULTY + "RETRY_DELAY = 200ms\n")
    (flaky,) = pipeline.publish("work", properties={"fault": "host", "times": 2})
    others = pipeline.publish("work", count=5)
    dispatcher = pipeline.start()
    wait_until(pipeline.settled, timeout=30, what="the retried message to finish")
    assert dispatcher.stop() == 0
    finished_once(pipeline, [flaky, *others])
    assert dispatcher.log.count("ConnectionError: upstream service unavailable; retry") == 2


def test_past_max_lifetime_goes_to_bounce_stage_or_fails(pipeline: Pipeline) -> None:
    pipeline.configure(
        "[stage-work]\nHANDLER = tests.stages:faulty\nRETRY_DELAY = 200ms\n"
        "MAX_LIFETIME = 1s\nBOUNCE_STAGE = dead\n"
        "[stage-alone]\nHANDLER = tests.stages:faulty\nRETRY_DELAY = 200ms\nMAX_LIFETIME = 1s\n"
        "[stage-dead]\nHANDLER = tests.stages:park\n"
    )
    dispatcher = pipeline.start()  # MAX_LIFETIME counts from arrival: publish once it runs
    (bounced,) = pipeline.publish("work", properties={"fault": "host"})
    (failed,) = pipeline.publish("alone", properties={"fault": "host"})
    wait_until(
        lambda: (
            (pipeline.row(bounced) or ("",))[0] == "dead"
            and (pipeline.row(failed) or ("", ""))[1] == "failed"
        ),
        timeout=30,
        what="retries to be exhausted",
    )
    assert dispatcher.stop() == 0
    _, _, state = pipeline.row(bounced) or ("", "", {})
    assert state["failure_class"] == "retries-exhausted"
    assert state["failed_stage"] == "work"
    assert state["temporary_failures"] >= 2
    stage, status, state = pipeline.row(failed) or ("", "", {})
    assert (stage, status, state["failure_class"]) == ("alone", "failed", "retries-exhausted")
    assert state["last_error"] == "ConnectionError: upstream service unavailable"


def test_permanent_error_fails_at_once(pipeline: Pipeline) -> None:
    pipeline.configure(FAULTY)
    (bad,) = pipeline.publish("work", properties={"fault": "permanent"})
    others = pipeline.publish("work", count=5)
    dispatcher = pipeline.start()
    wait_until(pipeline.settled, timeout=30, what="the permanent failure")
    assert dispatcher.stop() == 0
    stage, status, state = pipeline.row(bad) or ("", "", {})
    assert (stage, status) == ("work", "failed")
    assert state == {
        "last_error": "malformed input",
        "failed_stage": "work",
        "failure_class": "permanent",
    }
    finished_once(pipeline, others)


def test_exit_78_before_ready_then_fixed(pipeline: Pipeline) -> None:
    gate = pipeline.tmp / "gate"
    pipeline.extra_env["PEPSI_TEST_GATE"] = str(gate)
    pipeline.configure("[stage-work]\nHANDLER = tests.gate_stage:run\n")
    ids = pipeline.publish("work", count=8)
    dispatcher = pipeline.start()
    wait_until(lambda: dispatcher.log.count("refused to run (exit 78)") >= 2, what="refusals")
    assert "RuntimeError: the gate is closed" in dispatcher.log
    # nothing charged, nothing lost: every row waits (or is handed to the next
    # attempt after the cool-down), none was struck
    counts = pipeline.by_status()
    assert set(counts) <= {"pending", "running"}
    assert sum(counts.values()) == 8
    assert pipeline.scalar("SELECT count(*) FROM pepsi.workqueue WHERE state <> '{}'") == 0
    gate.write_text("open")
    wait_until(pipeline.settled, timeout=30, what="the stage to run once fixed")
    assert dispatcher.stop() == 0
    finished_once(pipeline, ids)


def test_kill_9_the_dispatcher_then_start_another(pipeline: Pipeline) -> None:
    pipeline.configure(FAULTY)
    ids = pipeline.publish("work", count=60, properties={"fault": "slow", "sleep": 0.05})
    first = pipeline.start()
    wait_until(lambda: pipeline.scalar("SELECT count(*) FROM test_effects") >= 5, what="progress")
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    # its workers see their input close and exit by themselves
    wait_until(lambda: pipeline.workers() == 0, timeout=30, what="orphaned workers to exit")
    left_running = pipeline.by_status().get("running", 0)
    second = pipeline.start()  # the lock died with the first one: no wait, no refusal
    if left_running:
        assert f"reset {left_running} leftover running rows to pending" in second.log
    wait_until(pipeline.settled, timeout=60, what="everything to finish")
    assert second.stop() == 0
    effects = pipeline.effects()
    assert set(effects) == {(i, "work") for i in ids}  # nothing lost


def test_sigterm_with_work_in_flight(pipeline: Pipeline) -> None:
    pipeline.configure(FAULTY)
    ids = pipeline.publish("work", count=40, properties={"fault": "slow", "sleep": 0.05})
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.scalar("SELECT count(*) FROM test_effects") >= 4, what="progress")
    started = time.monotonic()
    assert dispatcher.stop(signal.SIGTERM) == 0
    assert time.monotonic() - started < 10
    assert pipeline.by_status().get("running", 0) == 0
    # a session leaves pg_stat_activity when its server process ends, after the worker
    wait_until(lambda: pipeline.workers() == 0, timeout=10, what="the workers' sessions to end")
    again = pipeline.start()
    wait_until(pipeline.settled, timeout=60, what="the rest to finish")
    assert again.stop() == 0
    assert set(pipeline.effects()) == {(i, "work") for i in ids}


def test_failure_bouncer_moves_failed_messages_to_the_sink(pipeline: Pipeline) -> None:
    pipeline.configure(
        "[stage-work]\nHANDLER = tests.stages:faulty\n"
        "[stage-guarded]\nHANDLER = tests.stages:faulty\nBOUNCE_STAGE = work\n"
    )
    (bad,) = pipeline.publish("work", body=b"payload", properties={"fault": "permanent"})
    (kept,) = pipeline.publish("guarded", properties={"fault": "permanent"})
    dispatcher = pipeline.start()
    wait_until(lambda: pipeline.by_status() == {"failed": 2}, what="both to fail")
    assert dispatcher.stop() == 0
    done = subprocess.run(
        [sys.executable, "-m", "pepsi", "-c", str(pipeline.conf), "failure-bouncer", "--once"],
        env=pipeline.env(), cwd=REPO, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "moved 1 failed messages to table pepsi.dead_letter" in done.stdout
    assert pipeline.row(bad) is None
    assert pipeline.row(kept) is not None  # its stage has a BOUNCE_STAGE: not the bouncer's
    dead = pipeline.db.execute(
        "SELECT stage, status::text, state->>'failure_class', body FROM pepsi.dead_letter"
        " WHERE workqueue_id = %s",
        (bad,),
    ).fetchone()
    assert dead == ("work", "failed", "permanent", b"payload")
