from __future__ import annotations

from pepsi.dispatch.stats import STAGE_FIELDS, Stats
from pepsi.protocol import Pass


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


def test_wakeups_ride_along_and_do_not_make_a_flush_due() -> None:
    stats = Stats()
    stats.wakeup("poll")
    stats.wakeup("timer")
    assert not stats  # an idle heartbeat alone writes nothing
    assert not stats.empty()  # but shutdown writes what there is
    stats.count("claims")
    params = stats.take()
    assert (params["d_wakeups_poll"], params["d_wakeups_timer"], params["d_claims"]) == (1, 1, 1)
    assert stats.empty()


def test_fused_pass_counts_each_stage_with_its_outcome() -> None:
    stats = Stats()
    stats.passes("a", True, (Pass("a", 10, "advance"), Pass("b", 20, "finish")))
    stats.passes("a", False, (Pass("a", 5, "advance"), Pass("b", 7, "fail")))
    stats.passes("c", True, (Pass("c", 1, "retry"),))
    stats.passes("d", True, None)  # a program with no report: processed only
    params = stats.take()
    row = {
        name: dict(zip(STAGE_FIELDS, values, strict=True))
        for name, *values in zip(params["stages"], *(params[f] for f in STAGE_FIELDS), strict=True)
    }
    pick = ("processed", "failed", "finished", "advanced", "retries", "busy_us")
    assert [row["a"][k] for k in pick] == [2, 0, 0, 2, 0, 15]
    assert [row["b"][k] for k in pick] == [1, 1, 1, 0, 0, 27]  # the failed pass is not finished
    assert [row["c"][k] for k in pick] == [1, 0, 0, 0, 1, 1]
    assert [row["d"][k] for k in pick] == [1, 0, 0, 0, 0, 0]  # no report: processed only


def test_totals_keep_everything_since_start() -> None:
    stats = Stats()
    stats.count("claims", 2)
    stats.take()
    stats.count("claims", 3)
    stats.stage("a", "strikes")
    snap = stats.snapshot()
    assert snap.dispatch["claims"] == 5
    assert snap.stages["a"]["strikes"] == 1
    assert stats.delta.dispatch["claims"] == 3  # the snapshot is a copy
