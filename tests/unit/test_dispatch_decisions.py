"""The dispatcher's pure decisions: a worker's exit (W-6, W-7), tending (P-6), isolation,
the loop's sleep and its wakeup causes (P-3, P-9). No processes, no database, no clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pepsi.config import DispatchOptions
from pepsi.dispatch.policy import decisions
from pepsi.dispatch.policy.decisions import (
    Exit,
    FailedStart,
    Isolate,
    Kill,
    Lost,
    PoolRules,
    Retired,
    Stop,
    Struck,
    WorkerFacts,
)
from pepsi.dispatch.rows import pause_after_74
from pepsi.errors import EX_CONFIG, EX_IOERR, EX_TEMPFAIL

RULES = PoolRules(limit=4, max_runtime=10.0, max_messages=100, ready_timeout=60.0, idle_timeout=5.0)


def _exit(unanswered: tuple[int, ...] = (), **kw: object) -> Exit:
    base: dict[str, object] = {
        "returncode": -9,
        "was_ready": True,
        "expected": False,
        "reason": "killed by signal 9",
        "unanswered": unanswered,
    }
    return Exit(**{**base, **kw})  # type: ignore[arg-type]


# ---- on_exit: the W-6/W-7 tree ----------------------------------------------


def test_a_worker_asked_to_stop_gives_back_what_it_held_uncharged() -> None:
    assert decisions.on_exit(_exit((1, 2), expected=True)) == Retired((1, 2))


def test_expected_wins_over_everything_else() -> None:
    exit_ = _exit((7,), expected=True, was_ready=False, timed_out=True, garbled=True)
    assert decisions.on_exit(exit_) == Retired((7,))


def test_death_before_ready_charges_nobody_and_names_its_last_words() -> None:
    exit_ = _exit((1, 2, 3), was_ready=False, last_words="ImportError: no module x")
    assert decisions.on_exit(exit_) == FailedStart((1, 2, 3), "ImportError: no module x")


def test_death_before_ready_without_last_words_names_the_reason() -> None:
    exit_ = _exit((), was_ready=False, returncode=1, reason="exited with status 1")
    assert decisions.on_exit(exit_) == FailedStart((), "exited with status 1")


def test_exit_78_before_ready_is_a_refusal() -> None:
    exit_ = _exit((4,), was_ready=False, returncode=EX_CONFIG, last_words="bad HANDLER")
    assert decisions.on_exit(exit_) == FailedStart((4,), "refused to run (exit 78): bad HANDLER")


def test_exit_74_before_ready_is_the_database_not_the_stage() -> None:
    # no database (down, a failover under way): retried on the reconnect backoff
    exit_ = _exit((4,), was_ready=False, returncode=EX_IOERR, last_words="cannot connect")
    assert decisions.on_exit(exit_) == FailedStart((4,), "cannot connect", database=True)
    for code in (1, EX_TEMPFAIL, -9, None):  # 75 keeps START_COOLDOWN: connections are scarce
        other = _exit((4,), was_ready=False, returncode=code, last_words="x")
        assert decisions.on_exit(other) == FailedStart((4,), "x", database=False)


def test_a_ready_worker_dying_empty_is_only_a_warning() -> None:
    assert decisions.on_exit(_exit(())) == Lost()


def test_one_message_held_is_the_culprit() -> None:
    assert decisions.on_exit(_exit((9,))) == Struck(9, "crashed", ())


def test_a_hang_strikes_as_timed_out() -> None:
    assert decisions.on_exit(_exit((9,), timed_out=True)) == Struck(9, "timed-out", ())


def test_several_held_are_isolated_nobody_charged() -> None:
    assert decisions.on_exit(_exit((1, 2, 3))) == Isolate((1, 2, 3))


def test_a_hang_with_several_held_is_isolated_too() -> None:
    assert decisions.on_exit(_exit((1, 2), timed_out=True)) == Isolate((1, 2))


def test_a_solo_worker_names_its_head_and_requeues_the_rest() -> None:
    assert decisions.on_exit(_exit((5, 6), solo=True)) == Struck(5, "crashed", (6,))


def test_a_garbled_answer_strikes_the_head() -> None:
    assert decisions.on_exit(_exit((5, 6, 7), garbled=True)) == Struck(5, "crashed", (6, 7))


@given(
    unanswered=st.lists(st.integers(1, 10**6), unique=True, max_size=8).map(tuple),
    was_ready=st.booleans(),
    expected=st.booleans(),
    solo=st.booleans(),
    garbled=st.booleans(),
    timed_out=st.booleans(),
)
def test_every_unanswered_id_is_accounted_for_exactly_once(
    unanswered: tuple[int, ...],
    was_ready: bool,
    expected: bool,
    solo: bool,
    garbled: bool,
    timed_out: bool,
) -> None:
    exit_ = _exit(
        unanswered,
        was_ready=was_ready,
        expected=expected,
        solo=solo,
        garbled=garbled,
        timed_out=timed_out,
    )
    match decisions.on_exit(exit_):
        case Retired(ids) | FailedStart(ids, _) | Isolate(ids):
            accounted = list(ids)
            struck = False
        case Struck(wid, kind, rest):
            accounted = [wid, *rest]
            struck = True
            assert kind == ("timed-out" if timed_out else "crashed")
        case Lost():
            accounted, struck = [], False
    assert accounted == list(unanswered)
    # A strike needs a worker that was running and died on its own.
    assert not struck or (was_ready and not expected)


# ---- tend ---------------------------------------------------------------------


def test_a_worker_not_ready_in_time_is_killed() -> None:
    late = WorkerFacts(1, ready=False, started_at=0.0, idle_since=None)
    assert decisions.tend([late], RULES, now=60.1) == [Kill(1, "not ready after 60s")]
    assert decisions.tend([late], RULES, now=60.0) == []


def test_a_hung_head_kills_its_worker_as_timed_out() -> None:
    hung = WorkerFacts(1, inflight=3, head_since=100.0)
    kill = Kill(1, "gave no answer within MAX_RUNTIME (10s)", timed_out=True)
    assert decisions.tend([hung], RULES, now=110.5) == [kill]
    assert decisions.tend([hung], RULES, now=110.0) == []  # exactly MAX_RUNTIME: not yet


def test_an_idle_worker_stops_after_the_idle_timeout() -> None:
    idle = WorkerFacts(1, idle_since=100.0)
    assert decisions.tend([idle], RULES, now=104.9) == []
    assert decisions.tend([idle], RULES, now=105.0) == [Stop(1)]


def test_a_spent_worker_stops_once_empty() -> None:
    spent_busy = WorkerFacts(1, handled=100, inflight=1, head_since=0.0)
    spent_empty = WorkerFacts(2, handled=100, idle_since=0.0)
    assert decisions.tend([spent_busy, spent_empty], RULES, now=1.0) == [Stop(2)]


def test_surplus_workers_stop_the_emptiest_first() -> None:
    rules = PoolRules(1, 10.0, 100, 60.0, 5.0)
    busy = WorkerFacts(1, inflight=5, head_since=0.0)
    light = WorkerFacts(2, inflight=1, head_since=0.0)
    empty = WorkerFacts(3, idle_since=0.5)
    assert decisions.tend([busy, light, empty], rules, now=1.0) == [Stop(3), Stop(2)]


def test_stopping_workers_are_neither_killed_nor_counted() -> None:
    rules = PoolRules(1, 10.0, 100, 60.0, 5.0)
    leaving = WorkerFacts(1, stopping=True, inflight=1, head_since=0.0, idle_since=None)
    staying = WorkerFacts(2, inflight=1, head_since=99.0)
    assert decisions.tend([leaving, staying], rules, now=100.0) == []


def test_a_hung_idle_surplus_worker_is_killed_and_stopped() -> None:
    rules = PoolRules(0, 10.0, 100, 60.0, 5.0)
    hung = WorkerFacts(1, inflight=1, head_since=0.0)
    assert decisions.tend([hung], rules, now=11.0) == [
        Kill(1, "gave no answer within MAX_RUNTIME (10s)", timed_out=True),
        Stop(1),
    ]


def test_deadlines_are_when_tend_next_has_work() -> None:
    workers = [
        WorkerFacts(1, ready=False, started_at=1.0, idle_since=None),
        WorkerFacts(2, inflight=2, head_since=3.0),
        WorkerFacts(3, idle_since=4.0),
        WorkerFacts(4, stopping=True, inflight=1, head_since=0.0),
    ]
    assert sorted(decisions.deadlines(workers, RULES)) == [9.0, 13.0, 61.0]


def test_no_deadline_for_a_busy_worker_without_a_head_time() -> None:
    assert decisions.deadlines([WorkerFacts(1, inflight=1)], RULES) == []


@given(
    st.lists(
        st.builds(
            WorkerFacts,
            st.integers(1, 1000),
            ready=st.booleans(),
            stopping=st.booleans(),
            started_at=st.floats(0, 100),
            inflight=st.integers(0, 10),
            head_since=st.none() | st.floats(0, 100),
            idle_since=st.none() | st.floats(0, 100),
            handled=st.integers(0, 200),
        ),
        unique_by=lambda w: w.key,
        max_size=8,
    ),
    st.floats(0, 200),
    st.integers(0, 8),
)
def test_tend_never_touches_a_stopping_worker_nor_stops_more_than_it_may(
    workers: list[WorkerFacts], now: float, limit: int
) -> None:
    rules = PoolRules(limit, 10.0, 100, 60.0, 5.0)
    actions = decisions.tend(workers, rules, now)
    live = [w for w in workers if not w.stopping]
    assert {a.key for a in actions} <= {w.key for w in live}
    stops = [a.key for a in actions if isinstance(a, Stop)]
    assert len(stops) == len(set(stops))
    idle_or_spent = [
        w
        for w in live
        if (w.inflight == 0 and w.idle_since is not None and now - w.idle_since >= 5.0)
        or (w.handled >= 100 and w.inflight == 0)
    ]
    assert len(stops) <= max(0, len(live) - limit) + len(idle_or_spent)
    for kill in (a for a in actions if isinstance(a, Kill)):
        (w,) = [w for w in live if w.key == kill.key]
        assert (not w.ready and now - w.started_at > 60.0) or (
            kill.timed_out
            and w.ready
            and w.inflight
            and w.head_since is not None
            and now - w.head_since > 10.0
        )


# ---- isolation ------------------------------------------------------------------


def test_suspects_go_one_each_to_empty_ready_workers() -> None:
    workers = [
        WorkerFacts(1),
        WorkerFacts(2, inflight=1),
        WorkerFacts(3, ready=False),
        WorkerFacts(4, stopping=True),
        WorkerFacts(5),
    ]
    plan = decisions.isolate([10, 11, 12], workers, can_start=True)
    assert plan.to_existing == ((1, 10), (5, 11))
    assert plan.to_new == 12


def test_a_suspect_waits_when_no_worker_is_empty_and_none_may_start() -> None:
    plan = decisions.isolate([10], [WorkerFacts(1, inflight=1)], can_start=False)
    assert plan == decisions.IsolationPlan((), None)


# ---- the loop's sleep and wakeups ---------------------------------------------


def test_sleep_until_the_earliest_deadline_never_negative() -> None:
    assert decisions.sleep_time(10.0, [15.0, 12.5, 30.0]) == 2.5
    assert decisions.sleep_time(10.0, [9.0, 12.0]) == 0.0


def test_a_wakeup_without_an_event_is_the_poll_or_another_timer() -> None:
    assert decisions.wakeup_causes(set(), now=5.0, next_poll=5.0) == {"poll"}
    assert decisions.wakeup_causes(set(), now=4.0, next_poll=5.0) == {"timer"}
    assert decisions.wakeup_causes({"notify", "worker"}, 9.0, 5.0) == {"notify", "worker"}


def test_a_74_pauses_db_error_pause_but_briefly_once_the_database_is_back() -> None:
    options = DispatchOptions(db_error_pause=30.0, reconnect_max_delay=1.0)
    assert pause_after_74(options, now=100.0, back_at=None) == 30.0  # never seen away
    assert pause_after_74(options, now=100.0, back_at=95.0) == 1.0  # it just came back
    assert pause_after_74(options, now=130.0, back_at=95.0) == 30.0  # long since
    short = DispatchOptions(db_error_pause=0.5, reconnect_max_delay=1.0)
    assert pause_after_74(short, now=100.0, back_at=99.9) == 0.5  # never longer than asked
