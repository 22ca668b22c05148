"""The worker's pure decision: a stage's result (or error) → the row's update (W-2, W-3)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pepsi.config import StageConfig
from pepsi.stage import Advance, Finish, Message, Pause, PermanentError
from pepsi.worker.outcomes import (
    ERROR_LIMIT,
    FINISH,
    Decision,
    after_raise,
    after_return,
    retry_delay,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)
STAGES = frozenset({"a", "b", "dead"})
DEFAULTS = StageConfig("a")


def message(state: Any = None, *, arrived: datetime = NOW, **options: Any) -> Message:
    """A message at stage `a`, whose options are `a`'s configuration."""
    return Message(
        id=7,
        stage="a",
        arrived=arrived,
        options=StageConfig("a", **options),
        state={} if state is None else state,
    )


def at(moment: datetime) -> Callable[[], datetime]:
    return lambda: moment


def unread() -> datetime:
    raise AssertionError("the clock is read only for a host failure")


def returned(result: object, msg: Message, now: Callable[[], datetime] = unread) -> Decision:
    return after_return(result, msg, "{}", STAGES, now)


def raised(exc: Exception, msg: Message, now: Callable[[], datetime] = unread) -> Decision:
    return after_raise(exc, msg, "{}", now)


# --- retry timing -----------------------------------------------------------


def test_retry_delays_double_up_to_an_hour() -> None:
    first, cap = DEFAULTS.retry_delay, DEFAULTS.retry_max_delay  # the configuration's defaults
    assert [retry_delay(n, first, cap) for n in (1, 2, 3, 4, 5, 6)] == [
        60,
        120,
        240,
        480,
        960,
        1920,
    ]
    assert retry_delay(7, first, cap) == 3600
    assert retry_delay(1000, first, cap) == 3600  # no overflow however many failures


def test_retry_delays_follow_the_stage_settings() -> None:
    assert [retry_delay(n, 0.5, 3.0) for n in (1, 2, 3, 4, 5)] == [0.5, 1, 2, 3, 3]
    assert retry_delay(0, 10, 100) == 10  # a count below one is the first retry


@given(
    failures=st.integers(min_value=0, max_value=10_000),
    first=st.floats(min_value=0.001, max_value=1e6),
    cap=st.floats(min_value=0.001, max_value=1e7),
)
def test_retry_delay_grows_and_never_passes_the_cap(
    failures: int, first: float, cap: float
) -> None:
    delay = retry_delay(failures, first, cap)
    assert 0 < delay <= cap
    assert delay <= retry_delay(failures + 1, first, cap)


# --- what the stage returned ----------------------------------------------


def test_none_advances_to_next_without_reading_the_clock() -> None:
    msg = message({"seen": 1}, next="b")
    decision = returned(None, msg)
    assert decision == Decision("advance", "b", "pending", {"seen": 1})
    assert decision.exit_status == 0
    assert decision.row(7) == {
        "workqueue_id": 7,
        "stage": "b",
        "status": "pending",
        "timeout": None,
        "state": {"seen": 1},
    }


def test_none_at_the_last_stage_finishes() -> None:
    decision = returned(None, message())
    assert decision is FINISH
    assert (decision.outcome, decision.stage, decision.exit_status) == ("finish", None, 0)


def test_advance_to_names_its_stage_over_next() -> None:
    assert returned(Advance("dead"), message(next="b")).stage == "dead"
    assert returned(Advance(), message(next="b")).stage == "b"
    assert returned(Advance(), message()) is FINISH


def test_counts_start_again_at_a_new_stage_only() -> None:
    state = {"strikes": 2, "temporary_failures": 3, "keep": True}
    moved = returned(Advance("b"), message(dict(state)))
    assert moved.state == {"keep": True}
    again = returned(Advance("a"), message(dict(state)))  # the same stage: counts stay
    assert again.state == state


def test_advance_to_an_unknown_stage_is_a_host_failure() -> None:
    decision = returned(Advance("nowhere"), message(), at(NOW))
    assert (decision.outcome, decision.stage, decision.status) == ("retry", "a", "paused")
    assert decision.error == "advance to unknown stage 'nowhere'"
    assert decision.state is not None
    assert decision.state["last_error"] == decision.error


def test_finish_deletes_the_row_even_with_a_next_stage() -> None:
    assert returned(Finish(), message(next="b")) is FINISH


def test_pause_keeps_the_stage_until_the_given_time() -> None:
    until = NOW + timedelta(minutes=5)
    decision = returned(Pause(until), message({"x": 1}, next="b"))
    assert decision == Decision("pause", "a", "paused", {"x": 1}, until)
    assert decision.row(7)["timeout"] == until.isoformat()
    with_reason = returned(Pause(until, "waiting for stock"), message({"x": 1}))
    assert with_reason.state == {"x": 1, "pause_reason": "waiting for stock"}


@pytest.mark.parametrize(
    ("result", "text"),
    [
        (42, "stage returned 42, not an outcome"),
        ("b", "stage returned 'b', not an outcome"),
        (Pause("soon"), "stage returned Pause(until='soon', reason=None), not an outcome"),  # type: ignore[arg-type]
    ],
)
def test_anything_else_returned_is_a_host_failure(result: object, text: str) -> None:
    decision = returned(result, message(next="b"), at(NOW))
    assert (decision.outcome, decision.error) == ("retry", text)


# --- failures -----------------------------------------------------------------


def test_permanent_error_fails_at_once() -> None:
    decision = raised(PermanentError("bad input"), message({"x": 1}, next="b"))
    assert decision == Decision(
        "fail",
        "a",
        "failed",
        {"x": 1, "last_error": "bad input", "failed_stage": "a", "failure_class": "permanent"},
        error="bad input",
    )
    assert decision.exit_status == 1


def test_permanent_error_without_a_message_says_permanent() -> None:
    decision = raised(PermanentError(), message())
    assert decision.state is not None
    assert decision.state["last_error"] == "permanent"
    assert decision.error == ""  # logged as the stage raised it


def test_host_failure_pauses_with_backoff() -> None:
    decision = raised(RuntimeError("boom"), message({"temporary_failures": 2}), at(NOW))
    assert decision == Decision(
        "retry",
        "a",
        "paused",
        {"temporary_failures": 3, "last_error": "RuntimeError: boom"},
        NOW + timedelta(minutes=4),
        "RuntimeError: boom",
    )
    assert decision.exit_status == 0


def test_host_failure_backoff_follows_the_stage_and_stops_at_its_cap() -> None:
    def timeout_after(failures: int) -> timedelta:
        msg = message({"temporary_failures": failures}, retry_delay=10, retry_max_delay=35)
        decision = raised(ConnectionError("down"), msg, at(NOW))
        assert decision.timeout is not None
        return decision.timeout - NOW

    assert [timeout_after(n).total_seconds() for n in range(5)] == [10, 20, 35, 35, 35]


def test_host_failure_after_max_lifetime_fails_without_a_bounce_stage() -> None:
    late = NOW + timedelta(hours=2)
    decision = raised(RuntimeError("boom"), message(max_lifetime=3600), at(late))
    assert (decision.outcome, decision.stage, decision.status) == ("fail", "a", "failed")
    assert decision.timeout is None
    assert decision.exit_status == 1
    assert decision.state == {
        "last_error": "RuntimeError: boom",
        "temporary_failures": 1,
        "failed_stage": "a",
        "failure_class": "retries-exhausted",
    }


def test_host_failure_after_max_lifetime_goes_on_to_the_bounce_stage() -> None:
    late = NOW + timedelta(hours=2)
    msg = message({"strikes": 1}, max_lifetime=3600, bounce_stage="dead")
    decision = raised(RuntimeError("boom"), msg, at(late))
    assert (decision.outcome, decision.stage, decision.status) == ("advance", "dead", "pending")
    assert decision.exit_status == 0
    assert decision.state is not None
    assert decision.state["failure_class"] == "retries-exhausted"
    assert decision.state["failed_stage"] == "a"
    assert decision.state["strikes"] == 1  # the dead-letter stage sees the whole story


def test_max_lifetime_counts_from_arrival_and_is_exceeded_only_past_it() -> None:
    limit = message(max_lifetime=3600)
    assert raised(RuntimeError("x"), limit, at(NOW + timedelta(hours=1))).outcome == "retry"
    past = NOW + timedelta(hours=1, microseconds=1)
    assert raised(RuntimeError("x"), limit, at(past)).outcome == "fail"


def test_a_returned_failure_also_gives_up_past_max_lifetime() -> None:
    late = NOW + timedelta(hours=2)
    msg = message(max_lifetime=3600, bounce_stage="dead")
    assert returned(Advance("nowhere"), msg, at(late)).stage == "dead"


@pytest.mark.parametrize("fail", ["permanent", "host"])
def test_long_errors_are_truncated_in_state_not_in_the_log(fail: str) -> None:
    text = "x" * 10_000
    exc = PermanentError(text) if fail == "permanent" else RuntimeError(text)
    decision = raised(exc, message(), at(NOW))
    assert decision.state is not None
    stored = decision.state["last_error"]
    assert len(stored) == ERROR_LIMIT
    assert stored.endswith("…")
    assert decision.error is not None
    assert decision.error.endswith(text)


def test_an_error_of_exactly_the_limit_is_kept_whole() -> None:
    text = "y" * ERROR_LIMIT
    decision = raised(PermanentError(text), message())
    assert decision.state is not None
    assert decision.state["last_error"] == text


# --- the state check ----------------------------------------------------------


def test_a_state_that_is_not_json_is_a_host_failure_with_the_loaded_state() -> None:
    msg = message({"n": 1, "oops": {1, 2}}, next="b")
    decision = after_return(None, msg, '{"n": 1}', STAGES, at(NOW))
    assert decision.outcome == "retry"
    assert decision.error is not None
    assert decision.error.startswith("TypeError: state is not JSON:")
    assert decision.state == {
        "n": 1,
        "temporary_failures": 1,
        "last_error": decision.error,
    }


def test_a_state_that_is_not_an_object_is_a_host_failure_with_the_loaded_state() -> None:
    decision = after_return(None, message([1, 2], next="b"), '{"n": 1}', STAGES, at(NOW))
    assert decision.outcome == "retry"
    assert decision.error == "TypeError: state is not a JSON object but list"
    assert decision.state is not None
    assert decision.state["n"] == 1


def test_after_an_error_a_bad_state_is_replaced_quietly() -> None:
    loaded = '{"n": 1}'
    permanent = after_raise(PermanentError("no"), message({"bad": object()}), loaded, unread)
    assert permanent.state == {
        "n": 1,
        "last_error": "no",
        "failed_stage": "a",
        "failure_class": "permanent",
    }
    host = after_raise(RuntimeError("down"), message({"bad": object()}), loaded, at(NOW))
    assert host.error == "RuntimeError: down"  # the stage's own error, not the state's
    assert host.state == {"n": 1, "temporary_failures": 1, "last_error": "RuntimeError: down"}


@pytest.mark.parametrize(
    "result", [None, Advance("b"), Advance("nowhere"), Finish(), Pause(NOW, "r"), 42]
)
def test_deciding_never_changes_the_message(result: object) -> None:
    msg = message({"strikes": 1, "temporary_failures": 1, "deep": {"k": [1]}}, next="b")
    before = copy.deepcopy(msg.state)
    returned(result, msg, at(NOW))
    after_raise(RuntimeError("x"), msg, "{}", at(NOW))
    after_raise(PermanentError("x"), msg, "{}", at(NOW))
    assert msg.state == before


def test_a_decision_is_frozen() -> None:
    decision = returned(None, message(next="b"))
    with pytest.raises(AttributeError):
        decision.status = "failed"  # type: ignore[misc]


def test_an_advance_to_an_amqp_queue_goes_to_its_stage_in_full_form() -> None:
    assert returned(Advance(to="amqp:orders"), message()).stage == "amqp:/:orders"
    assert returned(Advance(to="amqp:/b2b:x:y"), message()).stage == "amqp:/b2b:x:y"
    assert returned(None, message(next="amqp:/:done")).stage == "amqp:/:done"
    bad = returned(Advance(to="amqp:"), message(), at(NOW))
    assert bad.outcome != "advance"
    assert "amqp:QUEUE" in (bad.error or "")
