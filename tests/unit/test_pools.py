from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pepsi.dispatch.policy.pools import (
    INITIAL_WINDOW,
    PREFETCH_SECONDS,
    Pace,
    WorkerLoad,
    assign,
    free_capacity,
    idle_to_stop,
    next_idle_deadline,
    room_for,
    worker_limit,
)


def load(key: int, inflight: int, queue_limit: int = 4, **kw: float | None) -> WorkerLoad:
    return WorkerLoad(key, inflight, room=queue_limit - inflight, **kw)  # type: ignore[arg-type]


def test_empty_stage_starts_with_one_worker() -> None:
    assert free_capacity([], limit=4, window=4) == 4


def test_pool_grows_one_worker_at_a_time() -> None:
    starting = WorkerLoad(1, 4, room=0, ready=False)
    assert free_capacity([starting], limit=4, window=4) == 0
    ready = WorkerLoad(1, 4, room=0, ready=True)
    assert free_capacity([ready], limit=4, window=4) == 4
    full = [WorkerLoad(k, 4, room=0) for k in range(4)]
    assert free_capacity(full, limit=4, window=4) == 0


def test_work_is_packed_onto_the_busiest_worker_first() -> None:
    workers = [load(1, 0), load(2, 3), load(3, 1)]
    plan = assign([10, 11, 12], workers, limit=4, window=4)
    assert plan.to_existing == {2: [10], 3: [11, 12]}
    assert plan.to_new == []


def test_new_worker_only_when_existing_are_full() -> None:
    plan = assign(list(range(6)), [load(1, 2)], limit=3, window=4)
    assert plan.to_existing == {1: [0, 1]}
    assert plan.to_new == [[2, 3, 4, 5]]


def test_light_load_settles_on_one_worker() -> None:
    plan = assign([1], [], limit=4, window=4)
    assert plan.to_new == [[1]]
    plan = assign([2], [load(1, 1)], limit=4, window=4)
    assert plan.to_existing == {1: [2]}


def test_beyond_capacity_is_left_over() -> None:
    assert assign(list(range(5)), [], limit=1, window=4).leftover == [4]
    plan = assign(list(range(5)), [], limit=4, window=4)  # one new worker at a time
    assert plan.leftover == [4]


def test_max_messages_budget_limits_room() -> None:
    assert room_for(inflight=1, handled=8, window=4, max_messages=10) == 1
    assert room_for(inflight=0, handled=10, window=4, max_messages=10) == 0
    assert room_for(inflight=0, handled=0, window=4, max_messages=10) == 4


def test_a_worker_is_topped_up_once_down_to_half_its_window() -> None:
    assert room_for(inflight=33, handled=0, window=64, max_messages=10**6) == 0
    assert room_for(inflight=32, handled=0, window=64, max_messages=10**6) == 32
    assert room_for(inflight=0, handled=0, window=1, max_messages=10**6) == 1
    assert room_for(inflight=1, handled=0, window=1, max_messages=10**6) == 0


def test_window_starts_small_and_follows_the_pace() -> None:
    pace = Pace()
    assert pace.window(64) == INITIAL_WINDOW
    assert pace.window(2) == 2
    pace.observe(0.00002)  # a no-op stage: the whole QUEUE_LIMIT
    assert pace.window(64) == 64
    slow = Pace()
    slow.observe(0.2)  # 200 ms a message: one at a time, spread over the pool
    assert slow.window(64) == 1
    medium = Pace()
    medium.observe(PREFETCH_SECONDS / 10)
    assert medium.window(64) == 10


def test_a_slowdown_shows_at_once_a_speedup_gradually() -> None:
    pace = Pace()
    for _ in range(100):
        pace.observe(0.0001)
    assert pace.window(64) == 64
    for _ in range(3):  # it now takes 100 ms a message
        pace.observe(0.1)
    assert pace.window(64) == 1
    windows = []
    for _ in range(60):  # fast again
        pace.observe(0.0001)
        windows.append(pace.window(64))
    assert windows == sorted(windows)
    assert windows[0] < 4
    assert windows[-1] == 64


def test_worker_limit_cap() -> None:
    assert worker_limit(4) == 4
    assert worker_limit(4, 2) == 2
    assert worker_limit(4, 0) == 1
    assert worker_limit(2, 8) == 2


def test_idle_workers() -> None:
    workers = [load(1, 0, idle_since=10.0), load(2, 0, idle_since=14.0), load(3, 2)]
    assert idle_to_stop(workers, now=15.0, idle_timeout=5.0) == [1]
    assert next_idle_deadline(workers, idle_timeout=5.0) == 15.0
    assert next_idle_deadline([load(1, 1)], idle_timeout=5.0) is None
    assert idle_to_stop([load(1, 0, idle_since=0.0)], now=5.0, idle_timeout=5.0) == [1]


@st.composite
def stages(draw: st.DrawFn) -> tuple[list[WorkerLoad], int, int]:
    queue_limit = draw(st.integers(1, 6))
    limit = draw(st.integers(1, 6))
    count = draw(st.integers(0, limit))
    workers = []
    for key in range(count):
        inflight = draw(st.integers(0, queue_limit))
        room = draw(st.integers(0, queue_limit - inflight))
        workers.append(WorkerLoad(key, inflight, room, ready=draw(st.booleans())))
    return workers, limit, queue_limit


@given(stages(), st.data())
def test_assignment_invariants(
    stage: tuple[list[WorkerLoad], int, int], data: st.DataObject
) -> None:
    workers, limit, queue_limit = stage
    free = free_capacity(workers, limit, queue_limit)
    n = data.draw(st.integers(0, free))
    ids = list(range(n))
    plan = assign(ids, workers, limit, queue_limit)
    assert plan.leftover == []
    given_ids = [i for batch in plan.to_existing.values() for i in batch] + [
        i for batch in plan.to_new for i in batch
    ]
    # every id goes somewhere exactly once, in order
    assert sorted(given_ids) == ids
    # no worker exceeds its room or the queue limit; the pool never exceeds its limit
    by_key = {w.key: w for w in workers}
    for key, batch in plan.to_existing.items():
        assert len(batch) <= by_key[key].room
    assert all(1 <= len(batch) <= queue_limit for batch in plan.to_new)
    assert len(workers) + len(plan.to_new) <= limit
    # slow start: at most one new worker, and none while another is starting
    assert len(plan.to_new) <= 1
    if any(not w.ready for w in workers):
        assert plan.to_new == []
    # a new worker is started only when no existing worker has room left
    if plan.to_new:
        assert all(len(plan.to_existing.get(w.key, [])) == w.room for w in workers)
