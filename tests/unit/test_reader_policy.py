from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta

from pepsi import policy
from pepsi.worker.reader import IdReader


def test_reader_takes_what_is_buffered_without_blocking() -> None:
    read_fd, write_fd = os.pipe()
    try:
        reader = IdReader(read_fd)
        os.write(write_fd, b"1\n2\n3\n4\n5\n6")  # "6" is not a whole line yet
        assert reader.read_batch(4) == [1, 2, 3, 4]
        assert reader.read_batch(4) == [5]  # a lone id is returned at once
        os.write(write_fd, b"\n7\n")
        assert reader.read_batch(1) == [6]
        assert reader.read_batch(10) == [7]
        os.close(write_fd)
        write_fd = -1
        assert reader.read_batch(4) == []
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


def test_retry_delays_double_up_to_an_hour() -> None:
    assert [policy.retry_delay(n) for n in (1, 2, 3, 4)] == [60, 120, 240, 480]
    assert policy.retry_delay(7) == 3600
    assert policy.retry_delay(1000) == 3600


NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_host_failure_pauses_then_gives_up_past_max_lifetime() -> None:
    decision = policy.on_host_failure(
        "s",
        {"temporary_failures": 2},
        "boom",
        arrived=NOW,
        now=NOW,
        max_lifetime=3600,
        bounce_stage=None,
    )
    assert decision.status == "paused"
    assert decision.timeout == NOW + timedelta(minutes=4)
    assert decision.state == {"temporary_failures": 3, "last_error": "boom"}

    late = NOW + timedelta(hours=2)
    failed = policy.on_host_failure(
        "s", {}, "boom", arrived=NOW, now=late, max_lifetime=3600, bounce_stage=None
    )
    assert (failed.status, failed.stage, failed.failure_class) == (
        "failed",
        "s",
        "retries-exhausted",
    )
    assert failed.state["failed_stage"] == "s"

    bounced = policy.on_host_failure(
        "s", {}, "boom", arrived=NOW, now=late, max_lifetime=3600, bounce_stage="dead"
    )
    assert (bounced.status, bounced.stage) == ("pending", "dead")


def test_permanent_error_fails_at_once() -> None:
    decision = policy.on_permanent_error("s", {"x": 1}, "bad input")
    assert decision.status == "failed"
    assert decision.state == {
        "x": 1,
        "last_error": "bad input",
        "failed_stage": "s",
        "failure_class": "permanent",
    }


def test_long_errors_are_truncated() -> None:
    decision = policy.on_permanent_error("s", {}, "x" * 10_000)
    assert len(decision.state["last_error"]) == policy.ERROR_LIMIT
