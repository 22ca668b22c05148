from __future__ import annotations

from pepsi.dispatch.stats import Stats


def test_counts_are_deltas_taken_once() -> None:
    stats = Stats()
    assert not stats
    stats.stage("a", "processed", 3)
    stats.stage("b", "busy_us", 120)
    stats.count("claims")
    stats.stage("a", "failed", 0)  # zero adds nothing
    assert stats
    params = stats.take()
    assert params["stages"] == ["a", "b"]
    assert params["processed"] == [3, 0]
    assert params["busy_us"] == [0, 120]
    assert params["d_claims"] == 1
    assert params["d_claimed"] == 0
    assert not stats  # taken: the next flush writes nothing
