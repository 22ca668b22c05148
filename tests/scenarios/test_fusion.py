"""Fusion never changes a message's outcome (W-10): the same random mix of outcomes
through a real dispatcher and real workers, with ALLOW_FUSION on and off, ends in
the same final states and runs the same stages for every message."""

from __future__ import annotations

import os
import random
from typing import Any

import psycopg

from pepsi import Advance, Finish, Message, PermanentError, stage
from tests.scenarios.conftest import Pipeline, wait_until

HERE = "tests.scenarios.test_fusion"
KINDS = ("through", "short", "refuse", "permanent", "host", "branch")
_connection: list[psycopg.Connection[Any]] = []


def _ran(msg: Message) -> None:
    if not _connection:
        _connection.append(psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True))
    _connection[0].execute(
        "INSERT INTO fusion_runs (key, stage) VALUES (%s, %s)", (msg.properties["key"], msg.stage)
    )


@stage
def first(msg: Message) -> Advance | Finish:
    _ran(msg)
    msg.state["n"] = 1
    kind = msg.properties["kind"]
    if kind == "short":
        return Finish()
    return Advance(fuse=kind != "refuse")


@stage
def second(msg: Message) -> Advance:
    _ran(msg)
    msg.state["n"] = msg.state.get("n", 0) + 1
    return Advance(to="side") if msg.properties["kind"] == "branch" else Advance()


@stage
def third(msg: Message) -> None:
    _ran(msg)
    kind = msg.properties["kind"]
    if kind == "permanent":
        raise PermanentError("refused at third")
    if kind == "host":
        raise RuntimeError("always down")  # past MAX_LIFETIME at once: to the bounce stage


@stage
def last(msg: Message) -> None:
    _ran(msg)


def configure(pipeline: Pipeline, fusion: str) -> None:
    pipeline.configure(
        f"[pepsi]\nALLOW_FUSION = {fusion}\n"
        f"[stage-s1]\nHANDLER = {HERE}:first\nNEXT = s2\nFUSION = yes\n"
        f"[stage-s2]\nHANDLER = {HERE}:second\nNEXT = s3\nFUSION = yes\n"
        f"[stage-s3]\nHANDLER = {HERE}:third\nNEXT = s4\nFUSION = yes\n"
        "MAX_LIFETIME = 1ms\nBOUNCE_STAGE = parked\n"
        f"[stage-s4]\nHANDLER = {HERE}:last\nFUSION = yes\n"
        f"[stage-side]\nHANDLER = {HERE}:last\nFUSION = yes\n"
        "[stage-parked]\nPROGRAM = /bin/false\n"  # never started: bounced rows wait here
    )


def run(pipeline: Pipeline, fusion: str, kinds: list[str]) -> tuple[Any, Any, int]:
    """Publish the mix, let it settle; (stages run per key, final rows, rows claimed)."""
    configure(pipeline, fusion)
    before = pipeline.scalar("SELECT coalesce(sum(claimed), 0) FROM pepsi.dispatch_stats")
    pipeline.db.execute("TRUNCATE fusion_runs")
    for key, kind in enumerate(kinds):
        pipeline.publish("s1", properties={"key": str(key), "kind": kind})
    dispatcher = pipeline.start()
    wait_until(
        lambda: (
            pipeline.scalar(
                "SELECT count(*) FROM pepsi.workqueue WHERE status IN ('pending', 'running', 'paused')"
                " AND stage <> 'parked'"
            )
            == 0
        ),
        timeout=90,
        what="the mix to settle",
    )
    assert dispatcher.stop() == 0
    ran = sorted(pipeline.db.execute("SELECT key, stage, count(*) FROM fusion_runs GROUP BY 1, 2"))
    final = sorted(
        pipeline.db.execute(
            "SELECT properties->>'key', stage, status::text, state->>'failure_class',"
            " state->>'failed_stage', state->>'n' FROM pepsi.workqueue"
        )
    )
    pipeline.db.execute("DELETE FROM pepsi.workqueue")
    claimed = pipeline.scalar("SELECT coalesce(sum(claimed), 0) FROM pepsi.dispatch_stats")
    return ran, final, int(claimed) - int(before)


def test_fusion_on_and_off_end_in_the_same_states(pipeline: Pipeline) -> None:
    pipeline.db.execute("CREATE TABLE fusion_runs (key text, stage text)")
    rng = random.Random(7)
    kinds = [rng.choice(KINDS) for _ in range(60)]
    fused_ran, fused_final, fused_claims = run(pipeline, "yes", kinds)
    plain_ran, plain_final, plain_claims = run(pipeline, "no", kinds)
    assert fused_ran == plain_ran  # every message ran the same stages, once each
    assert all(n == 1 for *_, n in fused_ran)
    assert fused_final == plain_final  # and ended in the same states
    assert {row[2] for row in fused_final} <= {"failed", "pending"}
    # Fusion did happen: most hops were never claimed.
    assert fused_claims < plain_claims / 2
