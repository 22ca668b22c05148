"""KnownPending: which stages are known empty (claims that only freed credit leave them
out), and how many rows others are known to hold (queue.declare's message_count)."""

from __future__ import annotations

from pepsi.dispatch.policy.known_pending import KnownPending, answer_is_news
from pepsi.protocol import Pass, StatusLine


def test_a_stage_whose_claim_found_nothing_is_skipped_until_news() -> None:
    known = KnownPending()
    assert known.room({"a": 5, "b": 3, "idle": 0}) == {"a": 5, "b": 3}
    known.claimed(["a", "b"], ["b", "b"])  # a found nothing, b found rows
    assert known.room({"a": 5, "b": 3}) == {"b": 3}
    known.claimed(["b"], [])
    assert known.room({"a": 5, "b": 3}) == {}
    known.heard()  # a publish, a worker's answer, a timer...
    assert known.room({"a": 5, "b": 3}) == {"a": 5, "b": 3}


def test_news_during_a_claim_counts_for_the_next_one() -> None:
    known = KnownPending()
    asked = known.room({"a": 1})
    known.heard()  # a NOTIFY while the claim ran: its row may be after the snapshot
    known.claimed(asked, [])
    assert known.pending("a") is None
    assert known.room({"a": 1}) == {"a": 1}


def test_a_claim_that_found_some_rows_says_nothing_about_the_rest() -> None:
    known = KnownPending()
    known.claimed(known.room({"a": 10}), ["a"])  # 1 of 10: a fair claim may leave rows
    assert known.pending("a") is None
    assert known.room({"a": 10}) == {"a": 10}


def test_a_stage_the_claim_drained_is_skipped_until_news() -> None:
    known = KnownPending()
    known.claimed(known.room({"a": 10, "b": 10}), ["a", "b"], drained=["a"])
    assert known.room({"a": 10, "b": 10}) == {"b": 10}  # b may have rows left
    known.changed({"a"})  # its rows requeued by the dispatcher
    assert known.pending("a") is None
    assert known.room({"a": 10, "b": 10}) == {"a": 10, "b": 10}


def test_news_during_a_claim_outlasts_what_it_drained() -> None:
    known = KnownPending()
    asked = known.room({"a": 10, "b": 10})
    known.published({"a": 1})  # the AMQP listener's commit, while the claim ran
    known.heard()  # a NOTIFY, while the claim ran
    known.claimed(asked, ["a", "b"], drained=["a", "b"])
    assert known.room({"a": 10, "b": 10}) == {"a": 10, "b": 10}


def test_a_publish_is_news_of_its_own_stages_only() -> None:
    known = KnownPending()
    known.claimed(known.room({"a": 1, "b": 1}), [])
    known.published({"a": 1})  # the AMQP listener committed a publish to a
    assert known.pending("a") == 1
    assert known.pending("b") == 0
    assert known.room({"a": 1, "b": 1}) == {"a": 1}
    known.published({"b": 1})  # while the claim of a runs
    known.claimed({"a": 1}, [])
    assert known.room({"a": 1, "b": 1}) == {"b": 1}


def test_the_listeners_commits_count_from_a_known_empty_stage() -> None:
    # Celery: the reply queue drained, a result published, the client declares it
    known = KnownPending()
    known.claimed(known.room({"reply": 8, "tasks": 8}), ["tasks"], drained=["tasks"])
    assert known.pending("reply") == 0
    known.published({"reply": 1})
    known.published({"reply": 2, "tasks": 1})
    assert (known.pending("reply"), known.pending("tasks")) == (3, 1)
    known.claimed(known.room({"reply": 2}), ["reply", "reply"])  # 2 of 3 taken
    assert known.pending("reply") == 1
    known.claimed(known.room({"reply": 8}), ["reply"], drained=["reply"])
    assert known.pending("reply") == 0


def test_a_count_is_unknown_when_rows_may_have_gone_another_way() -> None:
    known = KnownPending()
    known.claimed(known.room({"q": 1}), [])
    known.published({"q": 2})
    known.changed({"q"})  # basic.get took one, say
    assert known.pending("q") is None
    assert known.room({"q": 1}) == {"q": 1}
    known.claimed(["q"], [])
    known.published({"q": 1})
    known.claimed(known.room({"q": 5}), ["q", "q"])  # more than known: deleted by hand?
    assert known.pending("q") is None


def test_a_stage_whose_publishes_are_not_counted_is_not_known() -> None:
    known = KnownPending()
    known.claimed(known.room({"limited": 1, "free": 1}), [])
    known.published({"limited": None, "free": 4})  # a length limit may have dropped rows
    assert (known.pending("limited"), known.pending("free")) == (None, 4)


def test_a_publish_while_a_claim_runs_counts_if_the_stage_was_known() -> None:
    known = KnownPending()
    known.claimed(known.room({"q": 1, "idle": 1}), [])
    known.published({"q": 1, "idle": 1})
    asked = known.room({"q": 1, "idle": 0})  # idle's consumer has no credit left
    assert asked == {"q": 1}
    known.published({"q": 1, "idle": 1})  # the claim may or may not have seen q's new row
    known.claimed(asked, ["q"], drained=["q"])  # it took one of the two: one is left
    assert known.pending("q") == 1
    assert known.pending("idle") == 2  # no claim asked for it


def test_a_publish_while_a_claim_runs_leaves_an_unknown_stage_unknown() -> None:
    known = KnownPending()
    asked = known.room({"q": 5})  # q not known: its first claim
    known.published({"q": 1})  # before or after the claim's snapshot?
    known.claimed(asked, ["q"], drained=["q"])
    assert known.pending("q") is None


def test_any_other_news_makes_every_count_unknown() -> None:
    known = KnownPending()
    known.claimed(known.room({"a": 1, "b": 1}), [])
    known.published({"a": 2})
    known.heard()
    assert (known.pending("a"), known.pending("b")) == (None, None)


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
