"""Built-in stages in-process (`pepsi.testing.run_stage`): configured as in pepsi.conf."""

from __future__ import annotations

from typing import Any

import pytest

from pepsi.config import StageConfig, parse_config
from pepsi.config.ini import parse_ini
from pepsi.errors import WorkerRefused
from pepsi.stage import Needs, needs_of
from pepsi.stages import bounce, discard, if_, set_
from pepsi.testing import make_message, run_stage
from pepsi.worker.handlers import load_handler

CONF = """
[stage-check]
PROGRAM = pepsi-stage-if
IF = sender ~ "@spam\\.example$" or state.score >= 5
THEN = drop
ELSE = mark
[stage-gate]
PROGRAM = pepsi-stage-if
IF = properties.kind == "order"
THEN = mark
NEXT = drop
[stage-last]
PROGRAM = pepsi-stage-if
IF = properties.kind == "order"
THEN = mark
[stage-mark]
PROGRAM = pepsi-stage-set
SET = checked=yes, score=1.5, note="a, b", ok=true
NEXT = drop
[stage-tagged]
PROGRAM = pepsi-stage-tag
SET = tag=vip
NEXT = drop
[stage-drop]
PROGRAM = pepsi-stage-discard
[stage-back]
PROGRAM = pepsi-stage-bounce
REASON = not an order
[stage-back2]
PROGRAM = pepsi-stage-bounce
BOUNCE_STAGE = dead
[stage-dead]
HANDLER = tests.stages:noop
"""


@pytest.fixture(scope="module")
def stages() -> dict[str, StageConfig]:
    return dict(parse_config(parse_ini(CONF, "pepsi.conf")).stages)


def run(stages: dict[str, StageConfig], name: str, **fields: Any) -> Any:
    stage = stages[name]
    func = load_handler(stage)
    return run_stage(func, make_message(stage=name, options=stage, **fields), stages=stages)


def test_every_builtin_is_metadata_only_and_loads_through_the_worker(
    stages: dict[str, StageConfig],
) -> None:
    for name, module in (("check", if_), ("mark", set_), ("drop", discard), ("back", bounce)):
        func = load_handler(stages[name])
        assert func is module.run
        assert needs_of(func) is Needs.METADATA  # batched (W-8), fusable (W-10)
    assert load_handler(stages["tagged"]) is set_.run


def test_if_goes_to_then_when_the_condition_holds(stages: dict[str, StageConfig]) -> None:
    ran = run(stages, "check", sender="x@spam.example")
    assert (ran.outcome, ran.stage, ran.status) == ("advance", "drop", "pending")
    ran = run(stages, "check", sender="x@ok.example", state={"score": 7})
    assert ran.stage == "drop"


def test_if_goes_to_else_otherwise(stages: dict[str, StageConfig]) -> None:
    ran = run(stages, "check", sender="x@ok.example", state={"score": 2})
    assert (ran.outcome, ran.stage) == ("advance", "mark")
    assert ran.state == {"score": 2}  # a route writes nothing


def test_if_without_else_goes_to_next_or_finishes(stages: dict[str, StageConfig]) -> None:
    assert run(stages, "gate", properties={"kind": "order"}).stage == "mark"
    assert run(stages, "gate", properties={"kind": "other"}).stage == "drop"
    ran = run(stages, "last", properties={})
    assert (ran.outcome, ran.stage) == ("finish", None)


def test_set_writes_state_and_advances(stages: dict[str, StageConfig]) -> None:
    ran = run(stages, "mark", state={"score": 9, "kept": 1})
    assert (ran.outcome, ran.stage) == ("advance", "drop")
    assert ran.state == {"score": 1.5, "kept": 1, "checked": "yes", "note": "a, b", "ok": True}


def test_tag_is_set(stages: dict[str, StageConfig]) -> None:
    ran = run(stages, "tagged")
    assert (ran.outcome, ran.stage, ran.state) == ("advance", "drop", {"tag": "vip"})


def test_discard_finishes(stages: dict[str, StageConfig]) -> None:
    ran = run(stages, "drop", state={"a": 1})
    assert (ran.outcome, ran.stage, ran.status) == ("finish", None, None)


def test_bounce_without_bounce_stage_fails_the_message(stages: dict[str, StageConfig]) -> None:
    ran = run(stages, "back", state={"temporary_failures": 1})
    assert (ran.outcome, ran.stage, ran.status) == ("fail", "back", "failed")
    assert ran.state["last_error"] == "not an order"
    assert ran.state["failed_stage"] == "back"
    assert ran.state["failure_class"] == "permanent"


def test_bounce_with_bounce_stage_routes_there(stages: dict[str, StageConfig]) -> None:
    ran = run(stages, "back2", state={"strikes": 1, "x": 2})
    assert (ran.outcome, ran.stage, ran.status) == ("advance", "dead", "pending")
    assert ran.state == {
        "x": 2,
        "last_error": "bounced at stage back2",
        "failed_stage": "back2",
        "failure_class": "permanent",
    }  # per-stage counts start again at the new stage


def test_a_builtin_module_named_as_handler_is_refused() -> None:
    stage = StageConfig(name="x", handler="pepsi.stages.if_:run")
    with pytest.raises(WorkerRefused, match="PROGRAM = pepsi-stage-NAME"):
        load_handler(stage)


def test_if_routes_each_message_on_its_own(stages: dict[str, StageConfig]) -> None:
    """A batch of different messages through one `if` stage: each routed on its own."""
    senders = ["a@spam.example", "b@ok.example", "c@spam.example", None]
    routed = [run(stages, "check", sender=s).stage for s in senders]
    assert routed == ["drop", "mark", "drop", "mark"]
