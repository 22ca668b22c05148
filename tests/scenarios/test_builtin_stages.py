"""Built-in stages end to end: a pipeline of if, set, tag, discard and bounce, no Python."""

from __future__ import annotations

from tests.scenarios.conftest import Pipeline, wait_until

ROUTING = r"""
[stage-check]
PROGRAM = pepsi-stage-if
IF = sender ~ "@spam\.example$"
THEN = drop
ELSE = classify
[stage-classify]
PROGRAM = pepsi-stage-set
SET = checked=true, by="pepsi"
NEXT = route
[stage-route]
PROGRAM = pepsi-stage-if
IF = properties.kind in ["order", "refund"] and state.checked
THEN = keep
ELSE = reject
[stage-keep]
PROGRAM = pepsi-stage-tag
SET = kept=yes
NEXT = done
[stage-done]
PROGRAM = pepsi-stage-discard
[stage-drop]
PROGRAM = pepsi-stage-discard
[stage-reject]
PROGRAM = pepsi-stage-bounce
REASON = not an order
"""


def processed(pipeline: Pipeline) -> dict[str, tuple[int, int, int, int]]:
    """Per stage: (processed, failed, advanced, finished) as the dispatcher counted them."""
    rows = pipeline.db.execute(
        "SELECT stage, processed, failed, advanced, finished FROM pepsi.stage_stats"
    ).fetchall()
    return {str(r[0]): (int(r[1]), int(r[2]), int(r[3]), int(r[4])) for r in rows}


def test_messages_route_through_builtins_to_their_ends(pipeline: Pipeline) -> None:
    pipeline.configure(ROUTING, POLL_INTERVAL="30s")
    spam = pipeline.publish("check", count=3, sender="x@spam.example")
    orders = pipeline.publish(
        "check", count=2, sender="a@shop.example", properties={"kind": "order"}
    )
    orders += pipeline.publish("check", sender="b@shop.example", properties={"kind": "refund"})
    others = pipeline.publish("check", count=2, sender="c@shop.example", properties={"kind": "ad"})
    others += pipeline.publish("check", sender="d@shop.example")  # no kind at all
    dispatcher = pipeline.start()
    wait_until(pipeline.settled, timeout=60, what="the messages to settle")

    for wid in spam + orders:
        assert pipeline.row(wid) is None  # discarded: finished, the row deleted
    for wid in others:
        assert pipeline.row(wid) == (
            "reject",
            "failed",
            {
                "checked": True,
                "by": "pepsi",
                "last_error": "not an order",
                "failed_stage": "reject",
                "failure_class": "permanent",
            },
        )
    # The dispatcher's counters say which way each message went.
    wait_until(
        lambda: (
            processed(pipeline).get("done") == (3, 0, 0, 3)
            and processed(pipeline).get("reject") == (0, 3, 0, 0)
        ),
        what="the idle flush of the counters",
    )
    stats = processed(pipeline)
    assert stats["check"] == (9, 0, 9, 0)
    assert stats["drop"] == (3, 0, 0, 3)
    assert stats["classify"] == (6, 0, 6, 0)
    assert stats["route"] == (6, 0, 6, 0)
    assert stats["keep"] == (3, 0, 3, 0)
    assert "Traceback" not in dispatcher.log
    assert dispatcher.stop() == 0
