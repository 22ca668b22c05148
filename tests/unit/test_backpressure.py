from __future__ import annotations

from pepsi.dispatch.policy.backpressure import Cap, active, limit_for, on_tempfail

PARALLELISM = {"a": 4, "b": 8}


def test_the_stage_running_the_most_workers_is_halved() -> None:
    caps, halved = on_tempfail({}, {"a": 4, "b": 6}, PARALLELISM, now=0.0, window=300.0)
    assert halved == "b"
    assert caps == {"b": Cap(3, 300.0)}
    assert limit_for(caps, "b", 10.0) == 3
    assert limit_for(caps, "a", 10.0) is None


def test_repeats_lower_further_and_refresh_the_window_floor_one() -> None:
    caps, _ = on_tempfail({}, {"a": 4}, PARALLELISM, now=0.0, window=300.0)
    caps, _ = on_tempfail(caps, {"a": 2}, PARALLELISM, now=100.0, window=300.0)
    assert caps["a"] == Cap(1, 400.0)
    caps, _ = on_tempfail(caps, {"a": 1}, PARALLELISM, now=200.0, window=300.0)
    assert caps["a"] == Cap(1, 500.0)  # never below one worker


def test_recovers_when_the_window_passes() -> None:
    caps, _ = on_tempfail({}, {"a": 4}, PARALLELISM, now=0.0, window=300.0)
    assert active(caps, 299.0) == caps
    assert active(caps, 300.0) == {}
    assert limit_for(caps, "a", 301.0) is None


def test_nothing_running_nothing_halved() -> None:
    caps, halved = on_tempfail({}, {"a": 0}, PARALLELISM, now=0.0, window=300.0)
    assert (caps, halved) == ({}, None)
