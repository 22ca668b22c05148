"""Stage fusion (W-10): a StageRunner in-process against a real database.

One pass runs a chain of fusable stages on the loaded row and writes once;
every rule that forbids fusion makes the advance an ordinary written hop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.config import Config, load_config
from pepsi.protocol import parse_status
from pepsi.stage import Advance, Message, Needs, Pause, stage
from pepsi.worker.fusion import FUSION_DEPTH
from pepsi.worker.handlers import load_handler
from pepsi.worker.runner import StageRunner
from pepsi.worker.runtime import connect_worker
from tests.rows import running

Conn = psycopg.Connection[tuple[Any, ...]]
HERE = "tests.integration.test_fusion"


@stage
def mark(msg: Message) -> None:
    """Advances to NEXT, noting the stage in state."""
    msg.state[msg.stage] = True


@stage
def refuse(msg: Message) -> Advance:
    return Advance(fuse=False)


@stage
def fail(msg: Message) -> None:
    raise RuntimeError("upstream down")


@stage
def rewrite(msg: Message) -> None:
    msg.subject = "changed in memory"


@stage
def stop(msg: Message) -> Pause:
    return msg.pause(60)


@stage(Needs.BODY)
def reads_body(msg: Message) -> None:
    msg.state["length"] = len(msg.body or b"")


def conf(a: str = "mark", b: str = "mark", c: str = "mark", **extra: str) -> str:
    text = (
        f"[stage-a]\nHANDLER = {HERE}:{a}\nNEXT = b\n"
        f"[stage-b]\nHANDLER = {HERE}:{b}\nNEXT = c\nFUSION = {extra.get('b_fusion', 'yes')}\n"
        f"[stage-c]\nHANDLER = {HERE}:{c}\nFUSION = yes\nRETRY_DELAY = 7s\n"
    )
    if "allow" in extra:
        text = f"[pepsi]\nALLOW_FUSION = {extra['allow']}\n" + text
    return text


@pytest.fixture
def run(dsn: str, conn: Conn, tmp_path: Path) -> Iterator[Callable[[str, int], list[Any]]]:
    """Run stage a's worker on one row under a configuration; its report."""
    runners: list[StageRunner] = []

    def go(text: str, wid: int) -> list[Any]:
        path = tmp_path / "pepsi.conf"
        path.write_text(text)
        config: Config = load_config(path)
        first = config.stages["a"]
        runner = StageRunner(
            config, first, load_handler(first), connect_worker(dsn, "a", synchronous_commit=False)
        )
        runners.append(runner)
        (line,) = runner.run_batch([wid]).splitlines()
        status = parse_status(line)
        return [(p.stage, p.outcome) for p in status.report or ()]

    yield go
    for runner in runners:
        runner.conn.close()


def row(conn: Conn, wid: int) -> tuple[str, str, dict[str, Any]] | None:
    found = conn.execute(
        "SELECT stage, status::text, state FROM pepsi.workqueue WHERE workqueue_id = %s", (wid,)
    ).fetchone()
    return None if found is None else (found[0], found[1], found[2])


def test_a_chain_of_fusable_stages_runs_in_one_pass_and_writes_once(
    conn: Conn, run: Callable[[str, int], list[Any]]
) -> None:
    wid = running(conn)
    report = run(conf(), wid)
    assert report == [("a", "advance"), ("b", "advance"), ("c", "finish")]
    assert row(conn, wid) is None  # finished: the one write deleted it


def test_allow_fusion_no_writes_every_hop(conn: Conn, run: Callable[[str, int], list[Any]]) -> None:
    wid = running(conn)
    assert run(conf(allow="no"), wid) == [("a", "advance")]
    assert row(conn, wid) == ("b", "pending", {"a": True})


def test_a_successor_with_fusion_no_is_dispatched(
    conn: Conn, run: Callable[[str, int], list[Any]]
) -> None:
    wid = running(conn)
    assert run(conf(b_fusion="no"), wid) == [("a", "advance")]
    assert row(conn, wid) == ("b", "pending", {"a": True})


def test_a_stage_may_refuse_fusion_for_a_message(
    conn: Conn, run: Callable[[str, int], list[Any]]
) -> None:
    wid = running(conn)
    assert run(conf(a="refuse"), wid) == [("a", "advance")]
    assert row(conn, wid) == ("b", "pending", {})


def test_a_failure_is_handled_at_the_failing_stage_with_the_chain_before_it_kept(
    conn: Conn, run: Callable[[str, int], list[Any]]
) -> None:
    wid = running(conn, arrived=datetime.now(UTC))  # well within MAX_LIFETIME
    report = run(conf(c="fail"), wid)
    assert report == [("a", "advance"), ("b", "advance"), ("c", "retry")]
    found = row(conn, wid)
    assert found is not None
    stage_name, status, state = found
    assert (stage_name, status) == ("c", "paused")  # at c, with c's own RETRY_DELAY
    assert state["a"] is True
    assert state["b"] is True
    assert state["last_error"] == "RuntimeError: upstream down"
    waited = conn.execute(
        "SELECT round(extract(epoch FROM timeout - now())) FROM pepsi.workqueue"
        " WHERE workqueue_id = %s",
        (wid,),
    ).fetchone()
    assert waited is not None
    assert 5 <= float(waited[0]) <= 7


def test_a_rewritten_message_with_recipients_to_split_is_not_fused(
    conn: Conn, run: Callable[[str, int], list[Any]]
) -> None:
    """The manual: a later split clones its rows from the stored row, which must carry
    the rewrite, so the rewrite is written (issue 32: it is stored with the advance)."""
    wid = running(conn, recipients=["a@x.org", "b@x.org"])
    assert run(conf(a="rewrite"), wid) == [("a", "advance")]
    assert row(conn, wid) == ("b", "pending", {})
    assert subject(conn, wid) == "changed in memory"


def test_a_rewritten_message_with_one_recipient_is_fused_and_the_rewrite_stored(
    conn: Conn, run: Callable[[str, int], list[Any]]
) -> None:
    wid = running(conn, recipients=["a@x.org"])
    report = run(conf(a="rewrite", c="stop"), wid)
    assert report == [("a", "advance"), ("b", "advance"), ("c", "pause")]
    assert row(conn, wid) == ("c", "paused", {"b": True})
    assert subject(conn, wid) == "changed in memory"


def subject(conn: Conn, wid: int) -> str | None:
    found = conn.execute(
        "SELECT subject FROM pepsi.workqueue WHERE workqueue_id = %s", (wid,)
    ).fetchone()
    assert found is not None
    return found[0]


def test_a_successor_needing_more_than_is_loaded_is_dispatched(
    conn: Conn, run: Callable[[str, int], list[Any]]
) -> None:
    wid = running(conn, body=b"hello")
    assert run(conf(b="reads_body"), wid) == [("a", "advance")]
    assert row(conn, wid) == ("b", "pending", {"a": True})


def test_a_cycle_stops_at_the_depth_cap(conn: Conn, run: Callable[[str, int], list[Any]]) -> None:
    wid = running(conn)
    text = (
        f"[stage-a]\nHANDLER = {HERE}:mark\nNEXT = b\nFUSION = yes\n"
        f"[stage-b]\nHANDLER = {HERE}:mark\nNEXT = a\nFUSION = yes\n"
    )
    report = run(text, wid)
    assert len(report) == FUSION_DEPTH
    assert all(outcome == "advance" for _, outcome in report)
    found = row(conn, wid)
    assert found is not None
    assert found[1] == "pending"  # the advance after the cap is written
