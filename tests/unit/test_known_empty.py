"""KnownEmpty: which stages a claim that only freed credit asks for leaves out."""

from __future__ import annotations

from pepsi.dispatch.policy.known_empty import KnownEmpty, answer_is_news
from pepsi.protocol import Pass, StatusLine


def test_a_stage_whose_claim_found_nothing_is_skipped_until_news() -> None:
    known = KnownEmpty()
    assert known.room({"a": 5, "b": 3, "idle": 0}) == {"a": 5, "b": 3}
    known.claimed(["a", "b"], ["b", "b"])  # a found nothing, b found rows
    assert known.room({"a": 5, "b": 3}) == {"b": 3}
    known.claimed(["b"], [])
    assert known.room({"a": 5, "b": 3}) == {}
    known.heard()  # a publish, a worker's answer, a timer...
    assert known.room({"a": 5, "b": 3}) == {"a": 5, "b": 3}


def test_news_during_a_claim_counts_for_the_next_one() -> None:
    known = KnownEmpty()
    asked = known.room({"a": 1})
    known.heard()  # a NOTIFY while the claim ran: its row may be after the snapshot
    known.claimed(asked, [])
    assert known.room({"a": 1}) == {"a": 1}


def test_a_claim_that_found_some_rows_says_nothing_about_the_rest() -> None:
    known = KnownEmpty()
    known.claimed(known.room({"a": 10}), ["a"])  # 1 of 10: a fair claim may leave rows
    assert known.room({"a": 10}) == {"a": 10}


def test_a_stage_the_claim_drained_is_skipped_until_news() -> None:
    known = KnownEmpty()
    known.claimed(known.room({"a": 10, "b": 10}), ["a", "b"], drained=["a"])
    assert known.room({"a": 10, "b": 10}) == {"b": 10}  # b may have rows left
    known.heard_of({"a"})  # its rows requeued, or a publish the listener committed
    assert known.room({"a": 10, "b": 10}) == {"a": 10, "b": 10}


def test_news_during_a_claim_outlasts_what_it_drained() -> None:
    known = KnownEmpty()
    asked = known.room({"a": 10, "b": 10})
    known.heard_of({"a"})  # the AMQP listener's commit, while the claim ran
    known.heard()  # a NOTIFY, while the claim ran
    known.claimed(asked, ["a", "b"], drained=["a", "b"])
    assert known.room({"a": 10, "b": 10}) == {"a": 10, "b": 10}


def test_a_publish_is_news_of_its_own_stages_only() -> None:
    known = KnownEmpty()
    known.claimed(known.room({"a": 1, "b": 1}), [])
    known.heard_of({"a"})  # the AMQP listener committed a publish to a
    assert not known.empty("a")
    assert known.empty("b")
    assert known.room({"a": 1, "b": 1}) == {"a": 1}
    known.heard_of({"b"})  # while the claim of a runs
    known.claimed({"a": 1}, [])
    assert known.room({"a": 1, "b": 1}) == {"b": 1}


def _answer(status: int, *outcomes: str | None) -> StatusLine:
    report = tuple(Pass(f"s{i}", 10, o) for i, o in enumerate(outcomes)) if outcomes else None
    return StatusLine(status, report)


def test_an_answer_is_news_when_its_message_may_be_pending_somewhere() -> None:
    # settled where it ran: finished, paused, retried later, failed
    for outcome in ("finish", "pause", "retry"):
        assert not answer_is_news(_answer(0, outcome))
    assert not answer_is_news(_answer(1, "fail"))
    assert not answer_is_news(_answer(0, "advance", "advance", "finish"))  # a fused pass
    # pending at its next stage (or at BOUNCE_STAGE, an advance too)
    assert answer_is_news(_answer(0, "advance"))
    assert answer_is_news(_answer(0, "finish", "advance"))
    # the line does not say: another program, an older build, an unknown word
    assert answer_is_news(_answer(0))
    assert answer_is_news(_answer(0, None))
    # a status the dispatcher acts on itself (requeue, pause): its row becomes pending
    assert answer_is_news(_answer(75))
    assert answer_is_news(_answer(74, "finish"))
