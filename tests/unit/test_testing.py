"""pepsi.testing: a stage run in-process gives the worker's own decision."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pepsi import Message, Outcome, PermanentError, stage
from pepsi.config import StageConfig
from pepsi.testing import make_message, run_stage

NOW = datetime(2030, 1, 1, 12, tzinfo=UTC)


def clock() -> datetime:
    return NOW


@stage
def route(msg: Message) -> None:
    msg.state["routed"] = msg.properties.get("kind")


@stage(needs="body")
def parse(msg: Message) -> Outcome:
    order = msg.json()
    if order.get("wait"):
        return msg.pause(until=NOW + timedelta(minutes=5), reason="waiting")
    if order.get("elsewhere"):
        return msg.advance("other")
    return msg.finish()


def test_return_none_advances_to_next_with_the_state() -> None:
    msg = make_message(stage="route", next="archive", properties={"kind": "order"})
    ran = run_stage(route, msg)
    assert (ran.outcome, ran.stage, ran.status) == ("advance", "archive", "pending")
    assert ran.state == {"routed": "order"}
    assert ran.raised is None


def test_the_last_stage_finishes() -> None:
    ran = run_stage(route, make_message(stage="route"))
    assert (ran.outcome, ran.stage, ran.status) == ("finish", None, None)


def test_json_body_finish_pause_and_advance() -> None:
    assert run_stage(parse, make_message(json={"id": 7})).outcome == "finish"
    paused = run_stage(parse, make_message(json={"wait": True}))
    assert (paused.outcome, paused.status, paused.until) == (
        "pause",
        "paused",
        NOW + timedelta(minutes=5),
    )
    assert paused.state == {"pause_reason": "waiting"}
    moved = run_stage(parse, make_message(json={"elsewhere": True}), stages={"other"})
    assert (moved.outcome, moved.stage) == ("advance", "other")


def test_advance_to_an_unknown_stage_is_a_host_failure_when_stages_are_given() -> None:
    ran = run_stage(
        parse, make_message(json={"elsewhere": True}, arrived=NOW), stages={"x"}, now=clock
    )
    assert ran.outcome == "retry"
    assert ran.error == "advance to unknown stage 'other'"


def test_a_body_that_is_not_json_fails_the_message_permanently() -> None:
    ran = run_stage(parse, make_message(stage="parse", body=b"not json"))
    assert (ran.outcome, ran.status) == ("fail", "failed")
    assert ran.state["failure_class"] == "permanent"
    assert ran.state["last_error"].startswith("body is not JSON")
    assert isinstance(ran.raised, PermanentError)


def test_an_ordinary_exception_is_retried_as_the_worker_would() -> None:
    def flaky(msg: Message) -> None:
        raise RuntimeError("service unavailable")

    options = StageConfig(name="s", retry_delay=30.0)
    ran = run_stage(flaky, make_message(options=options, arrived=NOW), now=clock)
    assert (ran.outcome, ran.status) == ("retry", "paused")
    assert ran.until == NOW + timedelta(seconds=30)
    assert ran.state == {
        "last_error": "RuntimeError: service unavailable",
        "temporary_failures": 1,
    }


def test_retries_exhausted_after_max_lifetime_go_to_the_bounce_stage() -> None:
    def flaky(msg: Message) -> None:
        raise RuntimeError("down")

    options = StageConfig(name="s", max_lifetime=60.0, bounce_stage="bounce")
    msg = make_message(options=options, arrived=NOW - timedelta(hours=1))
    ran = run_stage(flaky, msg, now=clock)
    assert (ran.outcome, ran.stage, ran.status) == ("advance", "bounce", "pending")
    assert ran.state["failure_class"] == "retries-exhausted"


def test_a_state_that_is_not_json_is_a_host_failure_and_the_loaded_state_is_kept() -> None:
    def bad(msg: Message) -> None:
        msg.state["when"] = datetime.now(UTC)

    ran = run_stage(bad, make_message(state={"n": 1}, arrived=NOW), now=clock)
    assert ran.outcome == "retry"
    assert ran.state["n"] == 1
    assert "when" not in ran.state
    assert ran.state["last_error"].startswith("TypeError: state is not JSON")


def test_an_async_stage_runs_to_completion() -> None:
    async def later(msg: Message) -> Outcome:
        return msg.finish()

    assert run_stage(later, make_message()).outcome == "finish"


def test_make_message_defaults_and_fields() -> None:
    msg = make_message(sender="a@x.org", recipients=["b@y.org"], origin_user="u", body="hé")
    assert msg.stage == "test"
    assert msg.id == 1
    assert msg.recipients == ("b@y.org",)
    assert msg.body == "hé".encode()
    assert msg.header is None
    assert msg.content_type is None
    assert make_message(json=[1]).content_type == "application/json"
    with pytest.raises(ValueError, match="not both"):
        make_message(body=b"x", json=1)


def test_the_stage_s_state_is_not_shared_with_the_caller() -> None:
    state = {"seen": ["a"]}
    msg = make_message(state=state)
    msg.state["seen"].append("b")
    assert state == {"seen": ["a"]}


def test_a_split_shows_its_parts_and_the_messages_it_makes() -> None:
    from pepsi.stage import Defer, Finish, NewMessage, Part, Split  # noqa: PLC0415

    def relay(msg: Message) -> Split:
        return Split(
            (Part(("a@x.org",), Finish()), Part(("b@x.org",), Defer("451 later"))),
            spawn=(NewMessage("dsn", sender="", recipients=("s@y.org",)),),
        )

    ran = run_stage(relay, make_message(recipients=("a@x.org", "b@x.org"), sender="s@y.org"))
    assert ran.parts == ((("a@x.org",), "finish"), (("b@x.org",), "retry"))
    assert [m.stage for m in ran.spawned] == ["dsn"]
    assert (ran.stage, ran.status) == ("test", "paused")  # the row keeps the deferred group
