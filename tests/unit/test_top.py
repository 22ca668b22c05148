"""`pepsi top`'s arithmetic: frames and rates from two samples, no database."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from pepsi.top import DispatchCounters, Sample, StageCounters, frame, rate

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def sample(
    at: float,
    *,
    stats: dict[str, StageCounters] | None = None,
    counts: dict[str, dict[str, int]] | None = None,
    dispatch: DispatchCounters | None = None,
    workers: dict[str, int] | None = None,
    pid: int | None = None,
) -> Sample:
    return Sample(
        at=at,
        now=T0 + timedelta(seconds=at),
        counts=counts or {},
        stage_stats=stats or {},
        dispatch=dispatch or DispatchCounters(),
        workers=workers or {},
        dispatcher_pid=pid,
    )


def test_first_frame_has_counts_but_no_rates() -> None:
    first = sample(
        100.0,
        counts={"a": {"pending": 5, "running": 2, "paused": 1}, "b": {"failed": 3, "timeout": 4}},
        stats={"a": StageCounters(processed=10, strikes=2, retries=1)},
        workers={"a": 2},
        pid=4242,
        dispatch=DispatchCounters(claims=7, claimed=70, updated=T0),
    )
    view = frame(None, first, ["a", "b"])
    assert view.elapsed is None
    assert view.claims_rate is None
    assert view.claimed_rate is None
    assert view.dispatcher_running
    assert view.last_flush == T0
    assert view.flush_age == 100.0
    a, b = view.stages
    assert (a.stage, a.backlog, a.running, a.paused, a.failed, a.timeout) == ("a", 5, 2, 1, 0, 0)
    assert (a.workers, a.strikes, a.retries) == (2, 2, 1)
    assert set(a.rates) == {"processed", "failed", "finished", "advanced", "retries"}
    assert all(value is None for value in a.rates.values())
    assert (b.failed, b.timeout, b.workers) == (3, 4, 0)


def test_rates_are_deltas_over_elapsed_time() -> None:
    before = sample(
        10.0,
        stats={"a": StageCounters(processed=100, failed=1, finished=50, advanced=40, retries=2)},
        dispatch=DispatchCounters(claims=10, claimed=100),
    )
    after = sample(
        12.0,
        stats={"a": StageCounters(processed=300, failed=5, finished=150, advanced=140, retries=2)},
        dispatch=DispatchCounters(claims=14, claimed=300),
    )
    view = frame(before, after, ["a"])
    assert view.elapsed == 2.0
    assert dict(view.stages[0].rates) == {
        "processed": 100.0, "failed": 2.0, "finished": 50.0, "advanced": 50.0, "retries": 0.0,
    }  # fmt: skip
    assert (view.claims_rate, view.claimed_rate) == (2.0, 100.0)
    assert view.dispatcher_running is False
    assert view.last_flush is None
    assert view.flush_age is None


def test_stage_without_stats_row_shows_zeros() -> None:
    view = frame(sample(0.0), sample(1.0, counts={"a": {"pending": 3}}), ["a", "quiet"])
    quiet = view.stages[1]
    assert quiet.stage == "quiet"
    assert (quiet.backlog, quiet.running, quiet.workers, quiet.strikes, quiet.retries) == (
        0, 0, 0, 0, 0,
    )  # fmt: skip
    assert set(quiet.rates.values()) == {0.0}
    assert (view.claims_rate, view.claimed_rate) == (0.0, 0.0)  # no dispatch row: zeros too


def test_counter_that_went_backwards_gives_no_negative_rate() -> None:
    before = sample(
        0.0,
        stats={"a": StageCounters(processed=500, finished=400)},
        dispatch=DispatchCounters(claims=50),
    )
    after = sample(  # the stats table was reset, then counted a little again
        1.0,
        stats={"a": StageCounters(processed=20, finished=400)},
        dispatch=DispatchCounters(claims=3),
    )
    view = frame(before, after, ["a"])
    assert view.stages[0].rates["processed"] is None
    assert view.stages[0].rates["finished"] == 0.0
    assert view.claims_rate is None
    gone = frame(before, sample(1.0), ["a"])  # the row deleted outright
    assert gone.stages[0].rates["processed"] is None
    assert rate(5, 3, 1.0) is None
    assert rate(3, 5, 0.0) is None  # no time elapsed: nothing to divide by


def test_stages_found_in_the_tables_follow_the_configured_ones() -> None:
    current = sample(
        0.0,
        counts={"zombie": {"pending": 1}},
        stats={"retired": StageCounters(processed=1)},
        workers={"b": 1, "adhoc": 2},
    )
    assert [row.stage for row in frame(None, current, ["b", "a"]).stages] == [
        "b", "a", "adhoc", "retired", "zombie",
    ]  # fmt: skip


def test_frame_as_json() -> None:
    before = sample(0.0, stats={"a": StageCounters(processed=1)})
    after = sample(
        3.0,
        stats={"a": StageCounters(processed=2)},
        dispatch=DispatchCounters(updated=T0),
        pid=7,
    )
    data = json.loads(json.dumps(frame(before, after, ["a"]).as_dict()))
    assert data["elapsed_s"] == 3.0
    assert data["dispatcher"] == {
        "running": True, "pid": 7, "claims_per_s": 0.0, "claimed_per_s": 0.0,
        "last_flush": T0.isoformat(), "flush_age_s": 3.0,
    }  # fmt: skip
    assert data["stages"][0]["rates"]["processed"] == 0.333
