"""Per-address settings (W-9) on a real database: workqueue_split, `pepsi settings`,
and a StageRunner that overlays the overrides and splits diverging recipients."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from pepsi.cli import main
from pepsi.config import Config, load_config
from pepsi.protocol import parse_status
from pepsi.stage import Message, stage
from pepsi.worker.handlers import StageFunc
from pepsi.worker.runner import StageRunner
from pepsi.worker.runtime import connect_worker
from tests.rows import NOW
from tests.rows import running as running_row

Conn = psycopg.Connection[tuple[Any, ...]]

CONF = """
[stage-a]
HANDLER = tests.stages:noop
NEXT = b
RETRY_DELAY = 60s
RETRY_MAX_DELAY = 1h
MAX_LIFETIME = 1h
[stage-b]
HANDLER = tests.stages:noop
[stage-dead]
HANDLER = tests.stages:noop
[stage-tag]
PROGRAM = pepsi-stage-set
SET = seen=yes
[stage-route]
PROGRAM = pepsi-stage-if
IF = sender ~ "@vip\\.org$"
THEN = a
ELSE = b
"""


@pytest.fixture
def config(tmp_path: Path) -> Config:
    path = tmp_path / "pepsi.conf"
    path.write_text(CONF)
    return load_config(path)


def running(conn: Conn, recipients: list[str], *, sender: str = "s@y.org", **kw: Any) -> int:
    """A row as a claim leaves it: running at stage a, for these recipients."""
    return running_row(conn, "a", sender=sender, recipients=recipients, header="Subject: x", **kw)


def override(conn: Conn, address: str, options: dict[str, str], at: str = "a") -> None:
    conn.execute(
        "INSERT INTO pepsi.settings (address, stage, options) VALUES (%s, %s, %s)",
        (address, at, Jsonb(options)),
    )


def rows(conn: Conn) -> list[tuple[int, str, str, list[str], dict[str, Any], int | None]]:
    """(id, stage, status, recipients, state, body_id) of every row, by id."""
    return [
        (int(r[0]), r[1], r[2], list(r[3]), dict(r[4]), r[5])
        for r in conn.execute(
            "SELECT workqueue_id, stage, status::text, recipients, state, body_id"
            " FROM pepsi.workqueue ORDER BY workqueue_id"
        )
    ]


# --- pepsi.workqueue_split --------------------------------------------------------


def split(conn: Conn, wid: int, groups: object, at: str = "a") -> list[int] | None:
    found = conn.execute(
        "SELECT pepsi.workqueue_split(%s, %s, %s)", (wid, at, Jsonb(groups))
    ).fetchone()
    assert found is not None
    return None if found[0] is None else list(found[0])


def test_split_keeps_the_first_group_and_adds_pending_rows_sharing_the_body(conn: Conn) -> None:
    listener = psycopg.connect(conn.info.dsn, autocommit=True)
    listener.execute("LISTEN workqueue")
    wid = running(conn, ["a@x", "b@x", "c@x", "d@x"], state={"strikes": 1}, body=b"hello")
    new = split(conn, wid, [["a@x", "c@x"], ["b@x"], ["d@x"]])
    assert new is not None
    assert len(new) == 2
    (_, _, _, _, _, body_id), *_ = rows(conn)
    assert rows(conn) == [
        (wid, "a", "running", ["a@x", "c@x"], {"strikes": 1}, body_id),
        (new[0], "a", "pending", ["b@x"], {"strikes": 1, "split_from": wid}, body_id),
        (new[1], "a", "pending", ["d@x"], {"strikes": 1, "split_from": wid}, body_id),
    ]
    arrived = {r[0] for r in conn.execute("SELECT arrived FROM pepsi.workqueue")}
    assert arrived == {NOW}  # MAX_LIFETIME and TTL count from the message's arrival
    assert list(listener.notifies(timeout=0.3)) == []  # no NOTIFY: the worker's answer wakes
    listener.close()

    # The body stays while any row uses it, and goes with the last one.
    conn.execute("DELETE FROM pepsi.workqueue WHERE workqueue_id = ANY(%s)", ([wid, new[0]],))
    assert conn.execute("SELECT count(*) FROM pepsi.workqueue_body").fetchone() == (1,)
    conn.execute("DELETE FROM pepsi.workqueue WHERE workqueue_id = %s", (new[1],))
    assert conn.execute("SELECT count(*) FROM pepsi.workqueue_body").fetchone() == (0,)


@pytest.mark.parametrize(
    "groups",
    [
        [["a@x"], ["b@x"], ["c@x"]],  # c@x is not a recipient
        [["a@x"]],  # one group: nothing to split
        [["a@x"], []],  # an empty group
        [["a@x", "b@x"], ["b@x"]],  # b@x twice
        {"a@x": 1},  # not an array
    ],
)
def test_a_stale_or_malformed_plan_changes_nothing(conn: Conn, groups: object) -> None:
    wid = running(conn, ["a@x", "b@x"])
    before = rows(conn)
    assert split(conn, wid, groups) is None
    assert rows(conn) == before


def test_a_row_no_longer_running_at_the_stage_is_not_split(conn: Conn) -> None:
    wid = running(conn, ["a@x", "b@x"])
    assert split(conn, wid, [["a@x"], ["b@x"]], at="b") is None
    conn.execute("UPDATE pepsi.workqueue SET status = 'pending'")
    assert split(conn, wid, [["a@x"], ["b@x"]]) is None
    assert len(rows(conn)) == 1


# --- pepsi settings -----------------------------------------------------------------


@pytest.fixture
def cli(
    dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    (tmp_path / "pepsi.conf").write_text(CONF)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PEPSI_DSN", dsn)

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["settings", *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def test_settings_set_get_list_delete(cli: Callable[..., tuple[int, str, str]]) -> None:
    code, out, _ = cli("set", "Bob@Example.org", "a.retry_delay=10s", "a.BOUNCE_STAGE=dead")
    assert code == 0
    assert out.splitlines() == [
        "bob@example.org a.BOUNCE_STAGE = dead",
        "bob@example.org a.RETRY_DELAY = 10s",
    ]
    assert cli("set", "bob@example.org", "a.RETRY_DELAY=20s", "b.MAX_LIFETIME=2h")[0] == 0
    assert cli("set", "carol@example.org", "b.RETRY_DELAY=1s")[0] == 0
    code, out, _ = cli("get", "BOB@example.org")
    assert out.splitlines() == [
        "a.BOUNCE_STAGE = dead",
        "a.RETRY_DELAY = 20s",
        "b.MAX_LIFETIME = 2h",
    ]
    code, out, _ = cli("get", "bob@example.org", "--json")
    got = json.loads(out)
    assert [(g["stage"], g["options"]) for g in got] == [
        ("a", {"BOUNCE_STAGE": "dead", "RETRY_DELAY": "20s"}),
        ("b", {"MAX_LIFETIME": "2h"}),
    ]
    code, out, _ = cli("list", "--stage", "b")
    assert out.splitlines() == [
        "bob@example.org b.MAX_LIFETIME = 2h",
        "carol@example.org b.RETRY_DELAY = 1s",
    ]
    assert cli("delete", "bob@example.org", "a.RETRY_DELAY") == (0, "1 removed\n", "")
    assert cli("get", "bob@example.org")[1].splitlines() == [
        "a.BOUNCE_STAGE = dead",
        "b.MAX_LIFETIME = 2h",
    ]
    # Its last option gone, the stage's row goes too.
    assert cli("delete", "bob@example.org", "a.BOUNCE_STAGE", "a.NOPE")[1] == "1 removed\n"
    assert cli("delete", "bob@example.org", "b")[1] == "1 removed\n"
    assert cli("get", "bob@example.org") == (0, "", "")
    assert cli("delete", "carol@example.org")[1] == "1 removed\n"
    assert cli("list") == (0, "", "")
    # a built-in's own keys, and a domain's entry
    code, out, _ = cli("set", "vip.org", "tag.SET=seen=no, vip=true", "route.THEN=dead")
    assert (code, sorted(out.splitlines())) == (
        0,
        ["vip.org route.THEN = dead", "vip.org tag.SET = seen=no, vip=true"],
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("set", "a b@x", "a.RETRY_DELAY=1s"), "not an address: 'a b@x'"),
        (("set", "x@y", "nostage.RETRY_DELAY=1s"), "[stage-nostage] no such stage"),
        (("set", "x@y", "a.COLOUR=red"), "[stage-a] unknown key COLOUR"),
        (("set", "x@y", "a.NEXT=b"), "[stage-a] NEXT cannot be set per address: it shapes"),
        (("set", "x@y", "tag.PARALLELISM=2"), "[stage-tag] PARALLELISM cannot be set per "),
        (("set", "x@y", "tag.SET=strikes=1"), "state.strikes is Pepsi's own bookkeeping"),
        (("set", "x@y", "route.THEN=nowhere"), "[stage-route] THEN: no stage named 'nowhere'"),
        (("set", "x@y", "route.IF=sender ~"), "[stage-route] IF: "),
        (("set", "x@y", "a.SET=x=1"), "[stage-a] unknown key SET for [stage-a]"),
        (("set", "x@y", "a.RETRY_DELAY=soon"), "[stage-a] RETRY_DELAY: "),
        (("set", "x@y", "a.BOUNCE_STAGE=nowhere"), "no stage named 'nowhere'"),
        (("set", "x@y", "a.RETRY_DELAY"), "expected STAGE.KEY=VALUE, got 'a.RETRY_DELAY'"),
        (("set", "x@y", "RETRY_DELAY=1s"), "expected STAGE.KEY, got 'RETRY_DELAY'"),
        (("get", "@"), "not an address"),
        (("delete", "x@y", "a."), "expected STAGE.KEY, got 'a.'"),
    ],
)
def test_settings_mistakes_are_one_line_and_change_nothing(
    cli: Callable[..., tuple[int, str, str]], dsn: str, args: tuple[str, ...], message: str
) -> None:
    code, out, err = cli(*args)
    assert code == 2
    assert out == ""
    assert err.startswith("pepsi: ")
    assert message in err
    assert err.count("\n") == 1
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pepsi.settings").fetchone() == (0,)


# --- the worker -----------------------------------------------------------------------

ran: list[tuple[int, tuple[str, ...], float, float, str | None]] = []


@stage()
def record(msg: Message) -> None:
    """Remembers what it ran on, and under which options; fails as `fail` says."""
    options = msg.options
    ran.append(
        (msg.id, msg.recipients, options.retry_delay, options.max_lifetime, options.bounce_stage)
    )
    if msg.state.get("fail"):
        raise RuntimeError("upstream unavailable")


@pytest.fixture
def make_runner(dsn: str, config: Config) -> Iterator[Callable[[StageFunc], StageRunner]]:
    runners: list[StageRunner] = []
    ran.clear()

    def make(func: StageFunc) -> StageRunner:
        def open_connection() -> Conn:
            return connect_worker(dsn, "a", synchronous_commit=False)

        runner = StageRunner(
            config, config.stages["a"], func, open_connection(),
            reconnect=open_connection, now=lambda: NOW + timedelta(minutes=1),
        )  # fmt: skip
        runners.append(runner)
        return runner

    yield make
    for runner in runners:
        runner.conn.close()


def statuses(out: bytes) -> list[int]:
    return [parse_status(line).status for line in out.splitlines()]


def test_no_override_runs_under_the_stage_options_and_never_asks_per_batch(
    conn: Conn, make_runner: Callable[[StageFunc], StageRunner]
) -> None:
    runner = make_runner(record)
    wid = running(conn, ["a@x", "b@x"])
    assert statuses(runner.run_batch([wid])) == [0]
    assert ran == [(wid, ("a@x", "b@x"), 60.0, 3600.0, None)]
    assert not runner.overrides.exists
    assert [r[0] for r in rows(conn)] == [wid]  # advanced to b, not split
    # Within the recheck interval the worker does not look again: an override
    # set now is seen at the next check.
    override(conn, "a@x", {"RETRY_DELAY": "5s"})
    wid2 = running(conn, ["a@x"])
    runner.run_batch([wid2])
    assert ran[-1][2] == 60.0
    runner.overrides.checked = None  # the interval has passed
    wid3 = running(conn, ["a@x"])
    runner.run_batch([wid3])
    assert ran[-1] == (wid3, ("a@x",), 5.0, 3600.0, None)


def test_one_override_for_every_recipient_applies_without_a_split(
    conn: Conn, make_runner: Callable[[StageFunc], StageRunner]
) -> None:
    override(conn, "a@x", {"RETRY_DELAY": "5s"})
    override(conn, "b@x", {"RETRY_DELAY": "5"})
    override(conn, "b@x", {"RETRY_DELAY": "9s"}, at="b")  # another stage's: not this one
    wid = running(conn, ["A@x", "b@x"])
    assert statuses(make_runner(record).run_batch([wid])) == [0]
    assert ran == [(wid, ("A@x", "b@x"), 5.0, 3600.0, None)]
    assert len(rows(conn)) == 1


def test_local_origin_uses_the_senders_override(
    conn: Conn, make_runner: Callable[[StageFunc], StageRunner]
) -> None:
    override(conn, "s@y.org", {"MAX_LIFETIME": "2h"})
    override(conn, "b@x", {"RETRY_DELAY": "5s"})
    wid = running(conn, ["a@x", "b@x"], state={"local_origin": True})
    other = running(conn, ["a@x"])  # not local: its recipient's (none)
    make_runner(record).run_batch([wid, other])
    assert ran == [
        (wid, ("a@x", "b@x"), 60.0, 7200.0, None),
        (other, ("a@x",), 60.0, 3600.0, None),
    ]


def test_several_groups_split_and_each_row_runs_under_its_own(
    conn: Conn, make_runner: Callable[[StageFunc], StageRunner]
) -> None:
    override(conn, "b@x", {"RETRY_DELAY": "5s"})
    override(conn, "c@x", {"RETRY_DELAY": "7s", "BOUNCE_STAGE": "dead"})
    override(conn, "d@x", {"RETRY_DELAY": "5s"})
    wid = running(conn, ["a@x", "b@x", "c@x", "d@x", "e@x"], body=b"shared")
    plain = running(conn, ["b@x"])  # one group: no split, in the same batch
    runner = make_runner(record)
    assert statuses(runner.run_batch([wid, plain])) == [0, 0]
    assert ran == [(wid, ("a@x", "e@x"), 60.0, 3600.0, None), (plain, ("b@x",), 5.0, 3600.0, None)]
    after = rows(conn)
    body_id = after[0][5]
    assert [(r[1], r[2], r[3]) for r in after] == [
        ("b", "pending", ["a@x", "e@x"]),  # ran, advanced
        ("b", "pending", ["b@x"]),
        ("a", "pending", ["b@x", "d@x"]),  # new rows: at the same stage, to be claimed
        ("a", "pending", ["c@x"]),
    ]
    assert after[2][5] == after[3][5] == body_id is not None
    # The dispatcher claims the new rows; each runs once, under its own options.
    new = [r[0] for r in after[2:]]
    conn.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = ANY(%s)", (new,)
    )
    ran.clear()
    assert statuses(runner.run_batch(new)) == [0, 0]
    assert ran == [
        (new[0], ("b@x", "d@x"), 5.0, 3600.0, None),
        (new[1], ("c@x",), 7.0, 3600.0, "dead"),
    ]
    assert {r[1] for r in rows(conn)} == {"b"}


def test_a_crash_after_the_split_loses_nothing_and_doubles_nothing(
    conn: Conn, make_runner: Callable[[StageFunc], StageRunner]
) -> None:
    override(conn, "b@x", {"RETRY_DELAY": "5s"})

    @stage()
    def dies(msg: Message) -> None:
        raise SystemExit(137)  # the worker process goes: no outcome is written

    wid = running(conn, ["a@x", "b@x"])
    with pytest.raises(SystemExit):
        make_runner(dies).run_batch([wid])
    after = rows(conn)
    assert [(r[0], r[2], r[3]) for r in after] == [
        (wid, "running", ["a@x"]),  # the split is committed; the outcome is not
        (wid + 1, "pending", ["b@x"]),
    ]
    # The dispatcher strikes the row and resumes it later; the worker runs it again.
    runner = make_runner(record)
    assert statuses(runner.run_batch([wid])) == [0]
    conn.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = %s", (wid + 1,)
    )
    assert statuses(runner.run_batch([wid + 1])) == [0]
    assert ran == [(wid, ("a@x",), 60.0, 3600.0, None), (wid + 1, ("b@x",), 5.0, 3600.0, None)]
    assert [(r[0], r[1], r[3]) for r in rows(conn)] == [
        (wid, "b", ["a@x"]),
        (wid + 1, "b", ["b@x"]),
    ]


def test_an_override_can_make_the_stage_fail(
    conn: Conn, make_runner: Callable[[StageFunc], StageRunner]
) -> None:
    # A host failure is retried under the stage's options, but b@x's messages
    # may live only a second (arrived a minute ago): they fail at once, or go
    # to their own dead-letter stage.
    override(conn, "b@x", {"MAX_LIFETIME": "1s"})
    override(conn, "c@x", {"MAX_LIFETIME": "1s", "BOUNCE_STAGE": "dead"})
    wid = running(conn, ["a@x", "b@x", "c@x"], state={"fail": True})
    runner = make_runner(record)
    assert statuses(runner.run_batch([wid])) == [0]
    new = [r[0] for r in rows(conn)][1:]
    conn.execute(
        "UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = ANY(%s)", (new,)
    )
    assert statuses(runner.run_batch(new)) == [1, 0]
    outcome = {r[3][0]: (r[1], r[2], r[4].get("failure_class")) for r in rows(conn)}
    assert outcome == {
        "a@x": ("a", "paused", None),  # retried after RETRY_DELAY
        "b@x": ("a", "failed", "retries-exhausted"),
        "c@x": ("dead", "pending", "retries-exhausted"),
    }


def test_an_override_that_no_longer_fits_fails_that_message_only(
    conn: Conn, make_runner: Callable[[StageFunc], StageRunner]
) -> None:
    """The manual: an override that makes the stage's section unusable is a permanent
    error for that message, not for the stage. A recipient with one is split off and
    fails when its row runs; the others run."""
    override(conn, "a@x", {"BOUNCE_STAGE": "gone", "RETRY_DELAY": "5s"})
    wid = running(conn, ["a@x"])
    make_runner(record).run_batch([wid])
    assert ran == []
    ((_, stage, status, _, state, _),) = rows(conn)
    assert (stage, status, state["failure_class"]) == ("a", "failed", "permanent")
    assert state["last_error"] == "per-address settings: BOUNCE_STAGE: no stage named 'gone'"
    conn.execute("DELETE FROM pepsi.workqueue")
    both = running(conn, ["b@x", "a@x"])
    runner = make_runner(record)
    runner.run_batch([both])
    assert ran == [(both, ("b@x",), 60.0, 3600.0, None)]  # b@x ran; a@x went on a row of its own
    (clone,) = [r[0] for r in rows(conn) if r[0] != both]
    conn.execute("UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = %s", (clone,))
    runner.run_batch([clone])
    assert [(r[0], r[2], r[4].get("failure_class")) for r in rows(conn) if r[0] == clone] == [
        (clone, "failed", "permanent")
    ]


def test_a_split_by_settings_wakes_the_dispatcher_for_its_new_rows(
    dsn: str, conn: Conn, make_runner: Callable[[StageFunc], StageRunner]
) -> None:
    """The new rows are pending at this stage, and the worker's answer names only the
    first group's outcome: the split's statement sends a NOTIFY."""
    override(conn, "b@x", {"RETRY_DELAY": "5s"})
    wid = running(conn, ["a@x", "b@x"])
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN workqueue")
        make_runner(record).run_batch([wid])
        heard = [n.channel for n in listener.notifies(timeout=10, stop_after=1)]
    assert heard == ["workqueue"]
    assert [(r[2], r[3]) for r in rows(conn)] == [("pending", ["a@x"]), ("pending", ["b@x"])]
