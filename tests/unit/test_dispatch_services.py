"""The dispatcher's services driven in-process with an injected clock: the in-flight
ledger, the stats flusher, the sweeper's deadlines, the session's backoff, and the
pool supervisor's handling of exits, hangs, back-pressure and idle workers. No
database and no worker process: the supervisor's workers here are never started,
and what the tests look at is what the supervisor decided and recorded."""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime

import pytest

from pepsi.config import Config, DispatchOptions, StageConfig
from pepsi.dispatch.ledger import Claimed, InFlight
from pepsi.dispatch.policy.decisions import Exit
from pepsi.dispatch.policy.fairness import FairShare
from pepsi.dispatch.pools.pool import PoolOptions
from pepsi.dispatch.pools.supervisor import PoolSupervisor
from pepsi.dispatch.pools.workers import WorkerProcess
from pepsi.dispatch.rows import RowWriter, strike_delays
from pepsi.dispatch.services import reload
from pepsi.dispatch.services.flusher import StatsFlusher
from pepsi.dispatch.services.sweeper import Sweeper, SweepOptions
from pepsi.dispatch.session import SessionOptions
from pepsi.dispatch.stats import Stats
from pepsi.errors import EX_IOERR, EX_TEMPFAIL
from pepsi.protocol import Pass, StatusLine


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _ledger(clock: Clock, *, fair: bool = True) -> InFlight:
    share = FairShare(60.0, 10, clock) if fair else None
    return InFlight(RowWriter(DispatchOptions()), Stats(), share, clock)


def _status(code: int = 0, report: tuple[Pass, ...] | None = None) -> StatusLine:
    return StatusLine(code, report)


# ---- the in-flight ledger ---------------------------------------------------------


def test_a_claim_debits_each_sender_and_counts_once() -> None:
    ledger = _ledger(Clock())
    ledger.claimed([Claimed(1, "s", "a"), Claimed(2, "s", "a"), Claimed(3, "s", "b")])
    assert ledger.claimed_total == 3
    assert ledger.stats.delta.dispatch["claims"] == 1
    assert ledger.stats.delta.dispatch["claimed"] == 3
    assert ledger.fair is not None
    assert set(ledger.fair.ledger("s").debits) == {1, 2, 3}


def test_an_empty_claim_leaves_nothing_to_flush() -> None:
    ledger = _ledger(Clock())
    ledger.claimed([])
    assert not ledger.stats


def test_a_requeue_settles_row_stats_and_charge_together() -> None:
    ledger = _ledger(Clock())
    ledger.claimed([Claimed(1, "s", "a"), Claimed(2, "s", "a")])
    ledger.requeue("s", [1, 2])
    assert ledger.rows.requeues["s"] == [1, 2]
    assert ledger.stats.delta.stages["s"]["requeued"] == 2
    assert ledger.fair is not None
    ledger_s = ledger.fair.ledger("s")
    assert ledger_s.debits == {}
    assert ledger_s.lags.get("a", 0.0) == 0.0  # refunded: running nothing costs nothing


def test_requeueing_nothing_writes_nothing() -> None:
    ledger = _ledger(Clock())
    ledger.requeue("s", [])
    assert not ledger.rows
    assert ledger.rows.held() == []


def test_an_answer_is_counted_and_charged_at_its_measured_time() -> None:
    ledger = _ledger(Clock())
    ledger.claimed([Claimed(1, "s", "a")])
    report = (Pass("s", 250_000, "finish"),)
    assert ledger.answered("s", [(1, _status(0, report))]) is False
    assert ledger.answered_total == 1
    assert ledger.stats.delta.dispatch["stages_executed"] == 1
    assert ledger.stats.delta.stages["s"]["processed"] == 1
    assert ledger.stats.delta.stages["s"]["finished"] == 1
    assert ledger.fair is not None
    assert ledger.fair.ledger("s").debits == {}


def test_status_74_pauses_the_row_and_is_not_a_pass() -> None:
    clock = Clock(5.0)
    ledger = _ledger(clock)
    assert ledger.answered("s", [(7, _status(EX_IOERR))]) is False
    assert [(p.stage, p.wid, p.since) for p in ledger.rows.pauses] == [("s", 7, 5.0)]
    assert "s" not in ledger.stats.delta.stages
    assert ledger.held() == [7]


def test_status_75_requeues_and_asks_for_back_pressure() -> None:
    ledger = _ledger(Clock())
    assert ledger.answered("s", [(7, _status(EX_TEMPFAIL))]) is True
    assert ledger.rows.requeues["s"] == [7]
    assert ledger.stats.delta.stages["s"]["requeued"] == 1
    assert "processed" not in ledger.stats.delta.stages["s"]


def test_a_hang_is_charged_max_runtime_and_struck() -> None:
    ledger = _ledger(Clock())
    ledger.claimed([Claimed(1, "s", "a"), Claimed(2, "s", "b")])
    ledger.struck("s", 1, "timed-out", "worker killed", max_runtime=30.0)
    assert ledger.fair is not None
    lags = ledger.fair.ledger("s").lags
    assert lags["a"] > 29.0  # MAX_RUNTIME, not the small average it was debited
    assert [(s.wid, s.kind) for s in ledger.rows.strikes] == [(1, "timed-out")]
    assert ledger.stats.delta.stages["s"]["strikes"] == 1
    assert ledger.stats.delta.stages["s"]["timed_out"] == 1


def test_a_crash_keeps_its_debit_and_is_struck() -> None:
    ledger = _ledger(Clock(), fair=False)
    ledger.struck("s", 1, "crashed", "worker exited with status 3", max_runtime=30.0)
    assert [(s.wid, s.kind) for s in ledger.rows.strikes] == [(1, "crashed")]
    assert "timed_out" not in ledger.stats.delta.stages["s"]


def test_strike_delays_double_up_to_the_limit() -> None:
    assert strike_delays(60.0) == [60.0, 120.0]
    assert strike_delays(1.0, max_strikes=4) == [1.0, 2.0, 4.0]


# ---- the stats flusher ------------------------------------------------------------


def test_nothing_counted_is_never_due() -> None:
    clock = Clock(0.0)
    flusher = StatsFlusher(Stats(), 60.0, datetime.now(UTC), clock)
    clock.now = 1000.0
    assert not flusher.due(idle=True)
    assert flusher.deadlines(idle=True) == []


def test_busy_flushes_at_the_interval_idle_within_a_second() -> None:
    clock = Clock(0.0)
    stats = Stats()
    flusher = StatsFlusher(stats, 60.0, datetime.now(UTC), clock)
    stats.count("claims")
    clock.now = 30.0
    assert not flusher.due(idle=False)
    assert flusher.due(idle=True)  # last flush long ago
    assert flusher.deadlines(idle=False) == [60.0]
    assert flusher.deadlines(idle=True) == [60.0, 1.0]
    clock.now = 60.0
    assert flusher.due(idle=False)


def test_wakeups_alone_make_no_flush_due() -> None:
    clock = Clock(0.0)
    stats = Stats()
    flusher = StatsFlusher(stats, 60.0, datetime.now(UTC), clock)
    stats.wakeup("poll")
    clock.now = 100.0
    assert not flusher.due(idle=True)


# ---- the sweeper's deadlines --------------------------------------------------


def test_a_paused_row_due_sooner_moves_the_sweep_earlier_never_later() -> None:
    clock = Clock(100.0)
    sweeper = Sweeper(SweepOptions(5.0, 60.0, 3600.0, ()), Stats(), clock)
    sweeper.next_poll = 105.0
    sweeper.due_in(2.0)
    sweeper.due_in(30.0)
    sweeper.due_in(-1.0)  # already due: now
    assert sweeper.deadlines() == [105.0, 100.0]


def test_reconnects_back_off_from_100ms_to_reconnect_max_delay() -> None:
    options = SessionOptions("postgresql:///nowhere", 5.0, 10.0, reconnect_max=1.0)
    delays = list(itertools.islice(options.backoff.delays(lambda: 0.999999), 6))
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0], abs=1e-5)


# ---- the pool supervisor (workers never started) -----------------------------------


def _supervisor(
    clock: Clock, rng: float = 0.5, **stage: object
) -> tuple[PoolSupervisor, list[str]]:
    config = Config(
        None,
        stages={"s": StageConfig("s", handler="tests.stages:noop", **stage)},  # type: ignore[arg-type]
    )
    woken: list[str] = []

    def wake(cause: str, *, news: bool | set[str] = True) -> None:
        woken.append(cause if news is True else f"{cause} (no news)")

    options = PoolOptions(
        dsn="postgresql:///nowhere",
        config_file=None,
        config_path=None,
        idle_timeout=5.0,
        ready_timeout=60.0,
        stop_timeout=10.0,
        kill_grace=2.0,
        start_cooldown=5.0,
        tempfail_window=300.0,
        reconnect_max=1.0,
    )
    supervisor = PoolSupervisor(
        config, options, _ledger(clock), Stats(), wake=wake, clock=clock, rng=lambda: rng
    )
    return supervisor, woken


def _worker(
    supervisor: PoolSupervisor, key: int, ids: list[int], *, ready: bool = True
) -> WorkerProcess:
    """A worker as the supervisor tracks it, holding `ids`; its process never starts."""
    worker = WorkerProcess(
        key,
        "s",
        ["true"],
        {},
        on_ready=supervisor.on_ready,
        on_statuses=supervisor.on_statuses,
        on_answers=supervisor.on_answers,
        on_exit=supervisor.on_exit,
        kill_grace=2.0,
        clock=supervisor.clock,
    )
    worker.ready = ready
    worker.inflight.extend(ids)
    worker.idle_since = None if ids else worker.started_at
    worker.head_since = worker.started_at if ids else None
    supervisor.pools["s"].workers[key] = worker
    return worker


def _died(worker: WorkerProcess, *, ready: bool = True, **kw: object) -> Exit:
    return Exit(-9, ready, False, "killed by signal 9", tuple(worker.inflight), **kw)  # type: ignore[arg-type]


def test_an_empty_stage_can_take_one_new_workers_window() -> None:
    supervisor, _ = _supervisor(Clock())
    assert supervisor.capacities() == {"s": 4}  # INITIAL_WINDOW until the pace is known


def test_a_death_before_ready_requeues_and_cools_the_stage_down() -> None:
    clock = Clock(100.0)
    supervisor, woken = _supervisor(clock)
    worker = _worker(supervisor, 1, [10, 11], ready=False)
    supervisor.on_exit(worker, _died(worker, ready=False))
    assert supervisor.pools["s"].workers == {}
    assert supervisor.ledger.rows.requeues["s"] == [10, 11]
    assert supervisor.capacities() == {"s": 0}
    assert 105.0 in supervisor.deadlines()
    clock.now = 105.0
    assert supervisor.capacities() == {"s": 4}
    assert woken == ["worker"]


def test_a_worker_that_found_no_database_is_retried_on_the_reconnect_backoff() -> None:
    # Exit 74 before ready: a failover's symptom. The stage retries after 0.1 s,
    # doubling up to RECONNECT_MAX_DELAY (1 s), not after START_COOLDOWN (5 s).
    clock = Clock(100.0)
    supervisor, _ = _supervisor(clock, rng=0.999999)
    rests = []
    for key in range(1, 7):
        worker = _worker(supervisor, key, [key], ready=False)
        exit_ = Exit(EX_IOERR, False, False, "exited with status 74", (key,))
        supervisor.on_exit(worker, exit_)
        rests.append(supervisor.pools["s"].cooldown_until - clock.now)
    assert rests == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0], abs=1e-5)
    assert supervisor.capacities() == {"s": 0}
    clock.now += 1.0
    assert supervisor.capacities() == {"s": 4}
    # a worker that reaches the database ends the outage: the next one starts at 0.1 s again
    supervisor.on_ready(_worker(supervisor, 7, [], ready=False))
    worker = _worker(supervisor, 8, [8], ready=False)
    supervisor.on_exit(worker, Exit(EX_IOERR, False, False, "exited with status 74", (8,)))
    assert supervisor.pools["s"].cooldown_until - clock.now == pytest.approx(0.1, abs=1e-5)


def test_a_crash_holding_one_message_strikes_it() -> None:
    supervisor, _ = _supervisor(Clock())
    worker = _worker(supervisor, 1, [10])
    supervisor.on_exit(worker, _died(worker))
    assert [(s.wid, s.kind) for s in supervisor.ledger.rows.strikes] == [(10, "crashed")]
    assert supervisor.stats.delta.dispatch["workers_crashed"] == 1


def test_a_crash_holding_several_isolates_them_and_hands_them_out_one_each() -> None:
    clock = Clock()
    supervisor, _ = _supervisor(clock, parallelism=2)  # two empty workers: none may start
    worker = _worker(supervisor, 1, [10, 11, 12])
    supervisor.on_exit(worker, _died(worker))
    assert list(supervisor.pools["s"].isolate) == [10, 11, 12]
    assert supervisor.ledger.rows.strikes == []
    assert supervisor.capacities() == {"s": 1}  # a new worker's window, less the suspects
    empty = [_worker(supervisor, key, []) for key in (2, 3)]
    asyncio.run(supervisor.isolate())
    assert [list(w.inflight) for w in empty] == [[10], [11]]
    assert all(w.solo for w in empty)
    assert list(supervisor.pools["s"].isolate) == [12]
    assert supervisor.held() == [10, 11, 12]


def test_a_hung_worker_is_killed_and_its_message_struck_as_timed_out() -> None:
    clock = Clock(0.0)
    supervisor, _ = _supervisor(clock, max_runtime=10.0)
    worker = _worker(supervisor, 1, [10])

    async def tend_later() -> None:
        clock.now = 10.5
        supervisor.tend()

    asyncio.run(tend_later())
    assert worker.timed_out
    supervisor.on_exit(worker, _died(worker, timed_out=worker.timed_out))
    assert [(s.wid, s.kind) for s in supervisor.ledger.rows.strikes] == [(10, "timed-out")]


def test_a_75_halves_the_busiest_stage_at_the_next_tend() -> None:
    clock = Clock(0.0)
    supervisor, _ = _supervisor(clock, parallelism=4)
    workers = [_worker(supervisor, key, [key * 10]) for key in range(1, 5)]
    supervisor.on_statuses(workers[0], [(10, _status(EX_TEMPFAIL))])
    assert supervisor.tempfail_from == "s"

    async def tend() -> None:
        supervisor.tend()

    asyncio.run(tend())
    assert supervisor.cap("s", clock()) == 2
    assert supervisor.stats.delta.dispatch["backpressure_events"] == 1
    # the surplus two were asked to stop, the emptiest first
    assert sum(w.stopping for w in workers) == 2
    clock.now = 301.0
    assert supervisor.cap("s", clock()) is None


def test_an_answer_that_settled_its_message_wakes_without_news() -> None:
    """A finished, paused or failed message made no row pending: stages found empty
    stay out of the next claim; an advance (or a line without a report) is news."""
    supervisor, woken = _supervisor(Clock(0.0))
    worker = _worker(supervisor, 1, [10, 11, 12])
    finished = (10, StatusLine(0, (Pass("s", 5, "finish"),)))
    supervisor.on_statuses(worker, [finished, (11, StatusLine(0, (Pass("s", 5, "retry"),)))])
    supervisor.on_statuses(worker, [finished, (11, StatusLine(0, (Pass("s", 5, "advance"),)))])
    supervisor.on_statuses(worker, [(12, StatusLine(0))])
    assert woken == ["worker (no news)", "worker", "worker"]


def test_an_idle_worker_is_asked_to_stop_after_the_idle_timeout() -> None:
    clock = Clock(0.0)
    supervisor, _ = _supervisor(clock)
    worker = _worker(supervisor, 1, [])
    assert supervisor.deadlines() == [5.0]

    async def tend_at(now: float) -> None:
        clock.now = now
        supervisor.tend()

    asyncio.run(tend_at(4.0))
    assert not worker.stopping
    asyncio.run(tend_at(5.0))
    assert worker.stopping


# ---- reloads (P-10) --------------------------------------------------------------------


def test_a_reload_names_what_it_adds_removes_and_changes() -> None:
    old = {"a": StageConfig("a", handler="m:f"), "b": StageConfig("b", handler="m:g")}
    new = {"a": StageConfig("a", handler="m:f2"), "c": StageConfig("c", handler="m:h")}
    changes = reload.diff(old, new)
    assert changes == reload.StageChanges(added=("c",), removed=("b",), changed=("a",))
    assert changes.describe() == "added c; removed b; changed a"
    assert reload.diff(old, old).describe() == "no stage changed"


def test_a_reload_keeps_a_stages_history_and_retires_every_worker() -> None:
    supervisor, _ = _supervisor(Clock(), parallelism=2)
    pool = supervisor.pools["s"]
    pool.pace.observe(0.02)
    pool.isolate.extend([7])
    a, b = _worker(supervisor, 1, [10]), _worker(supervisor, 2, [])
    changed = StageConfig("s", handler="tests.stages:count", parallelism=3)
    retiring = supervisor.reconfigure(Config(None, stages={"s": changed}))
    assert retiring == [a, b]
    assert [a.stopping, b.stopping] == [True, True]  # no new ids for them
    assert supervisor.pools["s"] is pool  # its pace and suspects are kept
    assert pool.config == changed
    assert pool.pace.seconds == 0.02


def test_a_removed_stage_stays_reachable_until_its_workers_exit() -> None:
    supervisor, _ = _supervisor(Clock())
    worker = _worker(supervisor, 1, [10])
    supervisor.pools["s"].isolate.extend([11])
    supervisor.reconfigure(Config(None))
    assert supervisor.pools == {}
    assert supervisor.ledger.rows.requeues["s"] == [11]  # its suspect goes back
    assert supervisor.held() == [10]  # still in flight: not reset as an orphan
    supervisor.on_exit(worker, Exit(0, True, True, "exited with status 0", (10,)))
    assert supervisor.retired == {}
    assert supervisor.ledger.rows.requeues["s"] == [11, 10]


def test_a_claim_is_fed_with_the_window_it_was_sized_with() -> None:
    # Answers read while the claim statement ran may shrink the stage's window; the
    # claimed ids still go to the worker that had room for them, not back to pending.
    supervisor, _ = _supervisor(Clock(), parallelism=1, queue_limit=64)
    pool = supervisor.pools["s"]
    pool.pace.observe(0.0001)  # a fast stage: the whole QUEUE_LIMIT
    worker = _worker(supervisor, 1, [])
    assert supervisor.capacities() == {"s": 64}
    pool.pace.observe(0.1)  # an answer read during the claim: 100 ms a message
    assert pool.window() == 1
    asyncio.run(supervisor.feed([Claimed(wid, "s") for wid in range(64)]))
    assert list(worker.inflight) == list(range(64))
    assert supervisor.ledger.rows.requeues == {}
    assert supervisor.capacities() == {"s": 0}  # the next claim is sized with the new window
