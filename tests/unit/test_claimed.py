"""pepsi.admin.watch.claimed: which running rows `pepsi queue` shows as claimed (issue 33)."""

from __future__ import annotations

from pepsi.admin.watch.claimed import CLAIMED, has_worker_rows, label, split_counts


def test_running_rows_a_worker_has_not_started_are_claimed() -> None:
    started = frozenset({1})
    assert label("running", 1, "a", started) == "running"
    assert label("running", 2, "a", started) == CLAIMED
    assert label("pending", 2, "a", started) == "pending"
    assert label("running", 2, "amqp:/:q", started) == "running"  # its consumers'
    assert label("running", 2, "a", None) == "running"  # the dispatcher did not say


def test_counts_split_running_into_started_and_claimed() -> None:
    counts = {"a": {"pending": 3, "running": 5}, "b": {"running": 2}, "amqp:/:q": {"running": 4}}
    assert has_worker_rows(counts)
    assert split_counts(counts, {"a": 1}) == {
        "a": {"pending": 3, "running": 1, CLAIMED: 4},
        "b": {CLAIMED: 2},
        "amqp:/:q": {"running": 4},
    }
    assert split_counts({"a": {"running": 1}}, {"a": 3}) == {"a": {"running": 1}}
    assert not has_worker_rows({"amqp:/:q": {"running": 4}, "a": {"pending": 1}})
