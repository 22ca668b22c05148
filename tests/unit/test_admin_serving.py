"""Which waiting messages the running dispatcher does not serve (pepsi.admin.serving)."""

from __future__ import annotations

from pepsi.admin.serving import describe, unserved


def test_pending_messages_at_a_stage_the_dispatcher_lacks_are_named() -> None:
    pending = {"a": 3, "b": 5, "c": 0, "amqp:/:orders": 7}
    assert unserved(pending, {"a"}, running=True) == [("b", 5)]  # c: none waits; amqp: consumers
    assert unserved(pending, {"a", "b"}, running=True) == []
    assert unserved(pending, {"a"}, running=False) == []  # no dispatcher: said elsewhere
    assert unserved(pending, None, running=True) == []  # an older dispatcher said nothing
    assert describe("b", 5) == (
        "stage b: 5 pending message(s) that the running dispatcher does not serve "
        "(its configuration has no [stage-b]); they wait until one that does runs"
    )
