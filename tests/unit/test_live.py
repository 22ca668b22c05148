"""The live snapshot: its payload (pepsi.dispatch.services.live) and the rates read from it
(pepsi.admin.watch.live), no database: times are parameters."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime

import pytest

from pepsi.admin.watch.live import LIVE, NONE, STALE, STOPPED, LiveRates, LiveView
from pepsi.admin.watch.live_snapshot import Assembler, LiveSnapshot, StageLive, parse
from pepsi.admin.watch.top import LIVE as LIVE_SOURCE
from pepsi.admin.watch.top import STATS, Frame, StageRow, with_live
from pepsi.commands.operate.top_cmd import header
from pepsi.dispatch.services.live import (
    FIELDS,
    LIVE_HEARTBEAT,
    PAYLOAD_LIMIT,
    LivePublisher,
    heartbeat_bound,
    payloads,
)
from pepsi.dispatch.services.metrics import Gauges, Snapshot
from pepsi.dispatch.stats import Counts

START = 1_000_000.0  # the dispatcher's start, its wall clock
INTERVAL = 1.0
HEARTBEAT = heartbeat_bound(LIVE_HEARTBEAT, 5.0)  # 12.5 s with the default POLL_INTERVAL


def snap(
    seq: int,
    at: float,
    processed: int = 0,
    *,
    failed: int = 0,
    quiet_since: float | None = None,
    started: float = START,
    pid: int = 42,
    final: bool = False,
    claims: int = 0,
    stage: str = "a",
) -> LiveSnapshot:
    """Snapshot `seq`, taken `at` seconds after START."""
    return LiveSnapshot(
        pid=pid,
        started=started,
        at=START + at,
        seq=seq,
        quiet_since=START + (at if quiet_since is None else quiet_since),
        interval=INTERVAL,
        heartbeat=HEARTBEAT,
        final=final,
        dispatch={"claims": claims, "claimed": processed},
        stages={stage: StageLive({"processed": processed, "failed": failed}, 2, 1)},
    )


def feed(rates: LiveRates, *snapshots: LiveSnapshot) -> None:
    """Each snapshot received as it was taken (the reader's clock = seconds after START)."""
    for item in snapshots:
        rates.feed(item, item.at - START)


def processed(view: LiveView, stage: str = "a") -> float | None:
    return view.stages[stage].rates["processed"]


# ---- rates -------------------------------------------------------------------------------


def test_busy_rates_over_the_window() -> None:
    rates = LiveRates(window=10.0)
    # 100 messages a second from the start, 5 failures a second, a snapshot a second
    feed(rates, *(snap(3600 + n, 3600 + n, 100 * (3600 + n), failed=5 * (3600 + n))
                  for n in range(1, 31)))  # fmt: skip
    view = rates.view(3630.2)
    assert view.state == LIVE
    assert view.available
    assert view.window == 10.0
    assert processed(view) == 100.0
    assert view.stages["a"].rates["failed"] == 5.0
    assert (view.stages["a"].in_flight, view.stages["a"].workers) == (2, 1)
    assert view.dispatch["claimed"] == 100.0
    assert view.pid == 42


def test_a_reader_joining_a_long_run_waits_for_a_second_snapshot() -> None:
    rates = LiveRates()
    feed(rates, snap(500, 3600.0, 360_000))
    view = rates.view(3600.1)
    assert view.state == LIVE
    assert not view.available  # one point an hour after the start: no rate yet
    assert processed(view) is None
    feed(rates, snap(501, 3601.0, 360_100))
    view = rates.view(3601.1)
    assert (view.window, processed(view)) == (1.0, 100.0)
    feed(rates, *(snap(501 + n, 3601.0 + n, 360_100 + 50 * n) for n in range(1, 6)))
    view = rates.view(3606.0)
    assert view.window == 6.0  # the window grows to WINDOW as snapshots come
    assert processed(view) == pytest.approx(350 / 6)


def test_a_fresh_dispatcher_is_rated_from_its_start() -> None:
    rates = LiveRates()
    feed(rates, snap(1, 0.01))  # the first cycle announces the start: too soon to rate
    assert not rates.view(0.02).available
    feed(rates, snap(2, 2.0, 400))  # idle at first, then busy
    view = rates.view(2.0)
    assert view.window == 2.0
    assert processed(view) == 200.0  # since the start, counters all 0 then


def test_idle_after_busy_decays_to_zero_and_heartbeats_keep_it_live() -> None:
    rates = LiveRates(window=10.0)
    # busy: 10/s until 20 s; then the counters rest
    feed(rates, *(snap(n, float(n), 10 * n) for n in range(1, 21)))
    assert processed(rates.view(20.1)) == 10.0
    # no snapshot since 20 s: nothing changed since (a change is sent within an interval)
    view = rates.view(26.0)  # the window ends at 25 s
    assert view.state == LIVE
    assert view.window == 10.0
    assert processed(view) == pytest.approx(5.0)  # 50 in the last 10 s
    assert processed(rates.view(31.0)) == 0.0  # nothing since 20 s
    # the heartbeat: same counters, quiet since the last change
    feed(rates, snap(21, 32.0, 200, quiet_since=20.0))
    assert rates.view(44.0).state == LIVE
    assert processed(rates.view(44.0)) == 0.0
    # a silence past the heartbeat bound and three intervals: not heard from
    assert rates.view(32.0 + HEARTBEAT + 3 * INTERVAL - 0.1).state == LIVE
    stale = rates.view(32.0 + HEARTBEAT + 3 * INTERVAL + 0.1)
    assert stale.state == STALE
    assert not stale.available
    assert processed(stale) is None
    assert stale.age == pytest.approx(HEARTBEAT + 3 * INTERVAL + 0.1)


def test_a_heartbeat_alone_says_nothing_happened() -> None:
    """A reader that starts while the dispatcher idles: its first snapshot rates 0."""
    rates = LiveRates()
    feed(rates, snap(90, 3600.0, 5000, quiet_since=3000.0))
    view = rates.view(3600.0)
    assert (view.available, view.window, processed(view)) == (True, 10.0, 0.0)


def test_changes_between_snapshots_of_an_idle_dispatcher() -> None:
    rates = LiveRates(window=10.0)
    feed(rates, snap(10, 100.0, 1000, quiet_since=50.0))  # a heartbeat
    feed(rates, snap(11, 130.0, 1030))  # 30 more, at most an interval before 130
    view = rates.view(130.0)
    assert view.window == 10.0
    assert processed(view) == 3.0  # all 30 within the window, not spread over 30 s
    feed(rates, snap(13, 140.0, 1030, quiet_since=130.0))  # seq 12 lost: no matter
    assert processed(rates.view(145.0)) == 0.0


def test_a_restart_starts_over() -> None:
    rates = LiveRates()
    feed(rates, *(snap(n, float(n), 100 * n) for n in range(1, 11)))
    assert processed(rates.view(10.0)) == 100.0
    # a new dispatcher: its counters start at 0, seq at 1
    again = START + 20.0
    rates.feed(snap(1, 20.1, 0, started=again, pid=43), 20.1)
    view = rates.view(20.1)
    assert (view.pid, view.started) == (43, again)
    assert not view.available  # 0.1 s since its start: too short to rate, never negative
    rates.feed(snap(2, 22.0, 40, started=again, pid=43), 22.0)
    assert processed(rates.view(22.0)) == 20.0  # 40 since its start, 2 s ago


def test_counters_going_back_start_over_rather_than_rate_negatively() -> None:
    rates = LiveRates()
    feed(rates, *(snap(n, float(n), 100 * n) for n in range(1, 4)))
    feed(rates, snap(4, 4.0, 10))  # same pid and start: still a reset
    assert processed(rates.view(4.0)) is None  # one point again
    feed(rates, snap(5, 5.0, 60))
    assert processed(rates.view(5.0)) == 50.0


def test_a_repeated_or_late_snapshot_is_ignored() -> None:
    rates = LiveRates()
    feed(rates, *(snap(n, float(n), 100 * n) for n in range(1, 6)))
    rates.feed(snap(3, 3.0, 300), 5.5)
    assert rates.last is not None
    assert rates.last.seq == 5


def test_the_final_snapshot_says_stopped() -> None:
    rates = LiveRates()
    assert rates.view(0.0).state == NONE
    assert not rates.view(0.0).available
    feed(rates, *(snap(n, float(n), 100 * n) for n in range(1, 4)))
    feed(rates, snap(4, 4.0, 400, final=True))
    view = rates.view(4.0)
    assert view.state == STOPPED
    assert not view.available
    assert view.rate("a", "processed") is None


def test_a_stage_the_dispatcher_does_not_name_did_nothing() -> None:
    rates = LiveRates()
    feed(rates, snap(1, 1.0, 100), snap(2, 2.0, 200))
    view = rates.view(2.0)
    assert view.rate("a", "processed") == 100.0
    assert view.rate("gone", "processed") == 0.0
    assert json.loads(json.dumps(view.as_dict()))["stages"]["a"]["rates"]["processed"] == 100.0


# ---- the payload --------------------------------------------------------------------------


def snapshot_of(stages: dict[str, dict[str, int]], workers: dict[str, int]) -> Snapshot:
    counts = Counts({name: Counter(c) for name, c in stages.items()}, Counter(claims=7, claimed=70))
    return Snapshot(
        counts, Gauges(workers=workers, in_flight=dict.fromkeys(workers, 1), started=START)
    )


def test_payload_round_trip() -> None:
    snapshot = snapshot_of({"a": {"processed": 5, "failed": 1, "finished": 4}}, {"a": 2, "b": 0})
    (text,) = payloads(
        snapshot, seq=3, at=START + 9, quiet_since=START + 8, interval=1.0, heartbeat=12.5, pid=9
    )
    data = json.loads(text)
    assert data["fields"] == list(FIELDS)
    assert (data["v"], data["part"], data["parts"], data["dropped"]) == (1, 1, 1, 0)
    assert data["stages"]["a"] == [5, 1, 0, 4, 0, 0, 0, 1, 2]
    part = parse(text)
    assert (part.pid, part.started, part.at, part.seq) == (9, START, START + 9, 3)
    assert (part.quiet_since, part.interval, part.heartbeat, part.final) == (
        START + 8, 1.0, 12.5, False,
    )  # fmt: skip
    assert part.stages["a"] == StageLive(
        {"processed": 5, "failed": 1, "requeued": 0, "finished": 4, "advanced": 0,
         "retries": 0, "strikes": 0}, in_flight=1, workers=2,
    )  # fmt: skip
    assert part.stages["b"].workers == 0
    assert (part.dispatch["claims"], part.dispatch["claimed"]) == (7, 70)


def test_many_stages_are_split_into_parts_that_assemble() -> None:
    names = {f"stage-with-a-long-name-{n:04d}": {"processed": n} for n in range(400)}
    snapshot = snapshot_of(names, dict.fromkeys(names, 1))
    texts = payloads(snapshot, seq=1, at=START, quiet_since=START, interval=1.0, heartbeat=12.5)
    assert len(texts) > 1
    assert all(len(t.encode()) <= PAYLOAD_LIMIT for t in texts)
    assembler = Assembler()
    parts = [parse(t) for t in texts]
    assert {p.parts for p in parts} == {len(texts)}
    whole = None
    for part in reversed(parts):  # in any order
        assert whole is None
        whole = assembler.add(part)
    assert whole is not None
    assert (len(whole.stages), whole.dropped) == (400, 0)
    assert whole.stages["stage-with-a-long-name-0399"].counters["processed"] == 399
    # a part of a later snapshot drops what is left of an incomplete one
    assert assembler.add(parts[0]) is None
    later = [parse(t) for t in payloads(
        snapshot, seq=2, at=START + 1, quiet_since=START, interval=1.0, heartbeat=12.5
    )]  # fmt: skip
    results = [assembler.add(p) for p in later]
    assert results[-1] is not None
    assert results[-1].seq == 2
    assert results[:-1] == [None] * (len(later) - 1)


def test_past_the_cap_stages_are_dropped_and_counted() -> None:
    names = {f"s{n:05d}": {"processed": n} for n in range(3000)}
    snapshot = snapshot_of(names, {})
    texts = payloads(
        snapshot, seq=1, at=START, quiet_since=START, interval=1.0, heartbeat=12.5, max_parts=2
    )
    assert len(texts) == 2
    assert all(len(t.encode()) <= PAYLOAD_LIMIT for t in texts)
    parts = [parse(t) for t in texts]
    kept = sum(len(p.stages) for p in parts)
    assert {p.dropped for p in parts} == {3000 - kept}
    rates = LiveRates()
    assembler = Assembler()
    whole = [assembler.add(p) for p in parts][-1]
    assert whole is not None
    rates.feed(whole, 0.0)
    view = rates.view(0.0)
    assert view.dropped == 3000 - kept
    assert view.rate("s02999", "processed") is None  # unknown, not 0


def test_a_foreign_payload_is_refused() -> None:
    for text in ("", "hello", "[]", '{"v": 2}', '{"v": 1}', '{"v": 1, "fields": 3}'):
        with pytest.raises(ValueError, match="live snapshot"):
            parse(text)


# ---- when the dispatcher notifies ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_publisher_schedule() -> None:
    clock = Clock()
    counts = Counts()

    def take() -> Snapshot:
        out = Counts()
        out.add(counts)
        return Snapshot(out, Gauges(workers={"a": 1}, started=START))

    publisher = LivePublisher(take, clock, poll_interval=5.0, wall=lambda: START + clock.now)
    assert publisher.due(idle=True)  # the start is announced at once
    (first,) = publisher.take()
    assert (parse(first).seq, parse(first).quiet_since) == (1, START)
    # busy: every interval, with a deadline to wake the loop for it
    assert not publisher.due(idle=False)
    assert publisher.deadlines(idle=False) == [1.0]
    clock.now = 1.0
    assert publisher.due(idle=False)
    # idle, nothing changed: no deadline (the heartbeat rides on the loop's ticks) ...
    assert not publisher.due(idle=True)
    assert publisher.deadlines(idle=True) == []
    # ... and not before LIVE_HEARTBEAT - POLL_INTERVAL / 2
    clock.now = 7.4
    assert not publisher.due(idle=True)
    clock.now = 7.5
    assert publisher.due(idle=True)
    (beat,) = publisher.take()
    assert (parse(beat).seq, parse(beat).quiet_since, parse(beat).at) == (2, START, START + 7.5)
    # idle, a change (wakeups do not count): within an interval
    clock.now = 8.0
    counts.dispatch["wakeups_poll"] += 1
    assert publisher.deadlines(idle=True) == []
    counts.stages["a"] = Counter(processed=1)
    assert publisher.deadlines(idle=True) == [8.5]
    assert not publisher.due(idle=True)
    clock.now = 8.5
    assert publisher.due(idle=True)
    (change,) = publisher.take(final=True)
    assert parse(change).quiet_since == START + 8.5
    assert parse(change).final
    assert parse(change).heartbeat == HEARTBEAT
    # a POLL_INTERVAL longer than the heartbeat: every tick, at most once an interval
    assert heartbeat_bound(10.0, 30.0) == 30.0
    slow = LivePublisher(take, clock, poll_interval=30.0)
    slow.take()
    assert not slow.due(idle=True)
    clock.now = 9.5
    assert slow.due(idle=True)


def test_a_change_seen_is_not_looked_for_again_until_it_is_sent() -> None:
    """While idle the loop asks for deadlines every cycle: once a change is seen no snapshot
    is made to compare until the next one is sent; after it, changes are looked for again."""
    clock = Clock()
    counts = Counts()
    made = 0

    def take() -> Snapshot:
        nonlocal made
        made += 1
        out = Counts()
        out.add(counts)
        return Snapshot(out, Gauges(workers={"a": 1}, started=START))

    publisher = LivePublisher(take, clock, poll_interval=5.0)
    publisher.take()
    made = 0
    assert publisher.deadlines(idle=True) == []  # nothing changed: each cycle compares
    assert publisher.deadlines(idle=True) == []
    assert made == 2
    counts.stages["a"] = Counter(processed=1)
    for _ in range(5):
        assert publisher.deadlines(idle=True) == [1.0]
    assert made == 3  # seen once, then remembered
    clock.now = 1.0
    assert publisher.due(idle=True)
    publisher.take()
    made = 0
    assert publisher.deadlines(idle=True) == []  # sent: the same counters are no change
    assert made == 1


# ---- pepsi top ------------------------------------------------------------------------------


def test_top_shows_live_rates_when_there_are_some() -> None:
    row = StageRow("a", 5, 2, 0, 0, 0, 1, dict.fromkeys(("processed", "failed", "finished",
                   "advanced", "retries")), 0, 0)  # fmt: skip
    item = Frame(
        now=datetime(2026, 1, 1, tzinfo=UTC), window=None, dispatcher_pid=7, claims_rate=None,
        claimed_rate=None, last_flush=None, stages=(row,),
    )  # fmt: skip
    assert with_live(item, LiveView(NONE)) is item
    assert item.rates_source == STATS
    assert "rates: statistics flushes" in header(item)
    rates = LiveRates()
    feed(rates, *(snap(n, float(n), 100 * n, failed=n, claims=n) for n in range(1, 12)))
    shown = with_live(item, rates.view(11.0))
    assert shown.rates_source == LIVE_SOURCE
    assert (shown.window, shown.claims_rate, shown.claimed_rate) == (10.0, 1.0, 100.0)
    assert shown.stages[0].rates["processed"] == 100.0
    assert shown.stages[0].rates["failed"] == 1.0
    assert shown.stages[0].rates["finished"] is None  # not in this snapshot's counters
    assert shown.stages[0].backlog == 5  # the counts stay the queue's
    assert "rates: live, over 10s" in header(shown)
    assert shown.as_dict()["rates_source"] == "live"
