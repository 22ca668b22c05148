"""`pepsi top`'s arithmetic: frames, and rates over the flush window, no database."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from pepsi.admin.horizon import (
    HORIZON_WARN_AFTER,
    WARN_AFTER_ENV,
    Holder,
    is_late,
    warn_after,
    warning,
)
from pepsi.admin.watch.top import (
    RECENT,
    DispatchCounters,
    Sample,
    StageCounters,
    anchors,
    counts_due,
    frame,
    rate,
)
from pepsi.commands.operate.top_cmd import header
from pepsi.errors import ConfigError

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
INTERVAL = 60.0  # STATS_INTERVAL


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def sample(
    now: float,
    *,
    flushed: float | None = None,
    stats: dict[str, StageCounters] | None = None,
    counts: dict[str, dict[str, int]] | None = None,
    claims: int = 0,
    claimed: int = 0,
    workers: dict[str, int] | None = None,
    pid: int | None = 7,
    since: float = -3600.0,
) -> Sample:
    """A read at `now` seconds; the dispatcher (running since `since`, unless `pid`
    is None) last flushed at `flushed` seconds."""
    return Sample(
        now=at(now),
        counts=counts or {},
        stage_stats=stats or {},
        dispatch=DispatchCounters(claims, claimed, None if flushed is None else at(flushed)),
        workers=workers or {},
        dispatcher_pid=pid,
        dispatcher_since=None if pid is None else at(since),
    )


def view(samples: list[Sample], stages: list[str]) -> tuple[tuple[Sample, ...], Sample]:
    """Feed the samples as successive refreshes: (the window kept, the last one)."""
    seen: tuple[Sample, ...] = ()
    for item in samples:
        seen = anchors(seen, item)
    return seen, samples[-1]


def test_first_frame_has_counts_but_no_rates() -> None:
    first = sample(
        30.0,
        flushed=0.0,
        counts={"a": {"pending": 5, "running": 2, "paused": 1}, "b": {"failed": 3, "timeout": 4}},
        stats={"a": StageCounters(processed=10, strikes=2, retries=1)},
        workers={"a": 2},
        pid=4242,
        claims=7,
        claimed=70,
    )
    result = frame(anchors((), first), first, ["a", "b"], INTERVAL)
    assert result.window is None
    assert (result.claims_rate, result.claimed_rate) == (None, None)
    assert result.dispatcher_running
    assert (result.last_flush, result.flush_age) == (T0, 30.0)
    a, b = result.stages
    assert (a.stage, a.backlog, a.running, a.paused, a.failed, a.timeout) == ("a", 5, 2, 1, 0, 0)
    assert (a.workers, a.strikes, a.retries) == (2, 2, 1)
    assert set(a.rates) == {"processed", "failed", "finished", "advanced", "retries"}
    assert all(value is None for value in a.rates.values())
    assert (b.failed, b.timeout, b.workers) == (3, 4, 0)


def test_before_a_second_flush_the_last_minutes_give_rates_at_once() -> None:
    """Issue 33: after a burst, top showed no rates until a second flush: the per-minute
    counts (stage_stats_minute) of the last minute and this one give some at once."""
    first = replace(
        sample(30.0, flushed=0.0, counts={"a": {}}),
        recent={"a": (90, 3)},
        recent_since=at(30.0 - 90.0),  # the minute before this one began 90 s ago
    )
    result = frame(anchors((), first), first, ["a"], INTERVAL)
    assert (result.rates_source, result.window) == (RECENT, 90.0)
    (a,) = result.stages
    assert (a.rates["processed"], a.rates["failed"]) == (1.0, 3 / 90)
    assert a.rates["finished"] is None  # the minutes keep processed and failed only
    second = sample(40.0, flushed=35.0, stats={"a": StageCounters(processed=5)})
    later = frame(*view([first, second], ["a"]), ["a"], INTERVAL)
    assert later.rates_source != RECENT  # two flushes: their window again


def test_rates_span_the_last_two_flushes_not_the_refreshes() -> None:
    before = StageCounters(processed=100, failed=1, finished=50, advanced=40, retries=2)
    after = StageCounters(processed=700, failed=7, finished=350, advanced=340, retries=2)
    samples = [
        sample(1.0, flushed=0.0, stats={"a": before}, claims=10, claimed=100),
        sample(2.0, flushed=0.0, stats={"a": before}, claims=10, claimed=100),  # no flush yet
        sample(61.0, flushed=60.0, stats={"a": after}, claims=40, claimed=700),
        sample(62.0, flushed=60.0, stats={"a": after}, claims=40, claimed=700),  # a refresh later
    ]
    seen, current = view(samples, ["a"])
    result = frame(seen, current, ["a"], INTERVAL)
    assert result.window == 60.0  # flush to flush, by the server's timestamps
    # the same rates a refresh after the flush: no 0/s between flushes
    assert dict(result.stages[0].rates) == {
        "processed": 10.0, "failed": 0.1, "finished": 5.0, "advanced": 5.0, "retries": 0.0,
    }  # fmt: skip
    assert (result.claims_rate, result.claimed_rate) == (0.5, 10.0)


def test_no_flush_for_longer_than_the_interval_means_idle_zero() -> None:
    busy = StageCounters(processed=500)
    seen, current = view(
        [sample(1.0, flushed=0.0, stats={"a": busy}), sample(63.0, flushed=0.0, stats={"a": busy})],
        ["a"],
    )
    result = frame(seen, current, ["a"], INTERVAL)
    assert result.stages[0].rates["processed"] == 0.0
    assert result.claims_rate == 0.0
    assert result.window == 63.0  # nothing counted since the last flush
    # within the interval (plus slack) the missing flush proves nothing
    seen, current = view([sample(61.0, flushed=0.0, stats={"a": busy})], ["a"])
    assert frame(seen, current, ["a"], INTERVAL).stages[0].rates["processed"] is None


def test_a_flush_older_than_the_dispatcher_proves_nothing_until_the_interval() -> None:
    # the last flush was a previous dispatcher's, an hour ago; this one started 10 s ago
    fresh = sample(3600.0, flushed=0.0, since=3590.0)
    result = frame(anchors((), fresh), fresh, ["a"], INTERVAL)
    assert result.stages[0].rates["processed"] is None
    # running for longer than STATS_INTERVAL without a flush: it has counted nothing
    later = sample(3660.0, flushed=0.0, since=3590.0)
    result = frame(anchors((), later), later, ["a"], INTERVAL)
    assert result.stages[0].rates["processed"] == 0.0
    assert result.window == 70.0


def test_no_dispatcher_means_zero_rates() -> None:
    stopped = sample(10.0, flushed=0.0, pid=None)
    result = frame(anchors((), stopped), stopped, ["a"], INTERVAL)
    assert result.stages[0].rates["processed"] == 0.0
    assert result.claims_rate == 0.0
    assert result.window is None  # no window to speak of
    assert json.loads(json.dumps(result.as_dict()))["rate_window_s"] is None


def test_stage_without_stats_row_shows_zeros() -> None:
    seen, current = view(
        [sample(1.0, flushed=0.0), sample(11.0, flushed=10.0, counts={"a": {"pending": 3}})],
        ["a", "quiet"],
    )
    quiet = frame(seen, current, ["a", "quiet"], INTERVAL).stages[1]
    assert quiet.stage == "quiet"
    assert (quiet.backlog, quiet.running, quiet.workers, quiet.strikes, quiet.retries) == (
        0, 0, 0, 0, 0,
    )  # fmt: skip
    assert set(quiet.rates.values()) == {0.0}


def test_a_dispatcher_that_never_flushed() -> None:
    seen, current = view([sample(1.0, since=-5.0), sample(2.0, since=-5.0)], ["a"])
    assert seen == ()
    result = frame(seen, current, ["a"], INTERVAL)
    assert result.stages[0].rates["processed"] is None  # started 7 s ago: cannot tell yet
    assert (result.window, result.last_flush, result.flush_age) == (None, None, None)
    idle = sample(100.0, since=-5.0)  # 105 s without a flush: it has counted nothing
    assert frame((), idle, ["a"], INTERVAL).stages[0].rates["processed"] == 0.0


def test_counter_that_went_backwards_gives_no_negative_rate() -> None:
    seen, current = view(
        [
            sample(0.0, flushed=0.0, stats={"a": StageCounters(processed=500, finished=400)}),
            # the stats table was reset, then counted a little again
            sample(5.0, flushed=5.0, stats={"a": StageCounters(processed=20, finished=400)}),
        ],
        ["a"],
    )
    result = frame(seen, current, ["a"], INTERVAL)
    assert result.stages[0].rates["processed"] is None
    assert result.stages[0].rates["finished"] == 0.0
    assert rate(5, 3, 1.0) is None
    assert rate(3, 5, 0.0) is None  # no time elapsed: nothing to divide by


def test_stages_found_in_the_tables_follow_the_configured_ones() -> None:
    current = sample(
        0.0,
        counts={"zombie": {"pending": 1}},
        stats={"retired": StageCounters(processed=1)},
        workers={"b": 1, "adhoc": 2},
    )
    assert [row.stage for row in frame((), current, ["b", "a"], INTERVAL).stages] == [
        "b", "a", "adhoc", "retired", "zombie",
    ]  # fmt: skip


def test_frame_as_json() -> None:
    seen, current = view(
        [
            sample(0.0, flushed=0.0, stats={"a": StageCounters(processed=1)}),
            sample(4.0, flushed=3.0, stats={"a": StageCounters(processed=2)}, pid=7),
        ],
        ["a"],
    )
    data = json.loads(json.dumps(frame(seen, current, ["a"], INTERVAL).as_dict()))
    assert data["rate_window_s"] == 3.0
    assert data["dispatcher"] == {
        "running": True, "pid": 7, "claims_per_s": 0.0, "claimed_per_s": 0.0,
        "last_flush": at(3.0).isoformat(), "flush_age_s": 1.0,
    }  # fmt: skip
    assert data["stages"][0]["rates"]["processed"] == 0.333


def test_a_slow_queue_count_is_redone_less_often() -> None:
    assert counts_due(None, 5.0, 0.0, 1.0)  # never counted
    assert counts_due(100.0, 0.05, 101.0, 1.0)  # cheap: every refresh
    # 0.3 s a count (a million rows): at most a tenth of the time, so every 3 s
    assert not counts_due(100.0, 0.3, 101.0, 1.0)
    assert not counts_due(100.0, 0.3, 102.9, 1.0)
    assert counts_due(100.0, 0.3, 103.0, 1.0)
    old = sample(5.0, flushed=0.0)
    aged = replace(old, counts_age=2.5)
    assert frame((), aged, ["a"], INTERVAL).as_dict()["counts_age_s"] == 2.5


# Issue 13, defect 5: the oldest transaction holding back vacuum, and when to warn.
def test_horizon_warning_only_past_the_threshold() -> None:
    assert HORIZON_WARN_AFTER == 60.0  # docs/operations.md says so
    held = Holder(
        "session", 192.0, pid=1234, user="x", application="psql", client="local",
        state="idle in transaction",
    )  # fmt: skip
    assert not is_late(None, 0.0)
    assert not is_late(held, 192.0)  # exactly at the threshold: not yet
    assert is_late(held, 191.9)
    assert warning(held, HORIZON_WARN_AFTER) == (
        "warning: transaction of pid 1234 (user x, app psql, idle in transaction) has held "
        "back vacuum for 3m12s: dead rows pile up and the pipeline slows; end it or set "
        "idle_in_transaction_session_timeout"
    )
    assert warning(replace(held, age_s=59.0), HORIZON_WARN_AFTER) is None
    assert warning(None, 0.0) is None
    remote = replace(held, application=None, client="192.0.2.7:5050", state="active")
    assert remote.describe() == "pid 1234 (user x, from 192.0.2.7:5050, active)"
    prepared = Holder("prepared", 3600.0, user="app", gid="order-17")
    assert warning(prepared, 60.0) == (
        "warning: prepared transaction 'order-17' (owner app) has held back vacuum for 1h: "
        "dead rows pile up and the pipeline slows; COMMIT PREPARED or ROLLBACK PREPARED it"
    )


def test_horizon_threshold_from_the_environment() -> None:
    assert warn_after({}) == 60.0
    assert warn_after({WARN_AFTER_ENV: " "}) == 60.0
    assert warn_after({WARN_AFTER_ENV: "5m"}) == 300.0
    assert warn_after({WARN_AFTER_ENV: "0.5"}) == 0.5
    with pytest.raises(ConfigError, match=r"PEPSI_HORIZON_WARN_AFTER='soon': expected a duration"):
        warn_after({WARN_AFTER_ENV: "soon"})


def test_the_frame_carries_the_oldest_transaction() -> None:
    held = Holder("session", 75.0, pid=99, user="x", state="idle in transaction")
    item = frame((), replace(sample(5.0, flushed=0.0), horizon=held), ["a"], INTERVAL)
    assert item.horizon == held
    data = json.loads(json.dumps(item.as_dict()))
    assert data["oldest_transaction"]["pid"] == 99
    assert data["oldest_transaction"]["age_s"] == 75.0
    assert data["oldest_transaction"]["state"] == "idle in transaction"
    assert header(item).endswith(" · oldest transaction 1m15s (pid 99)")
    none = frame((), sample(5.0, flushed=0.0), ["a"], INTERVAL)
    assert none.as_dict()["oldest_transaction"] is None
    assert "oldest transaction" not in header(none)
