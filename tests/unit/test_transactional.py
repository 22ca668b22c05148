"""Transactional stages (issue 18), the pure parts: the decorator, msg.db, fusion."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from pepsi.config import StageConfig
from pepsi.errors import PepsiError
from pepsi.stage import Message, Needs, is_transactional, needs_of, stage
from pepsi.worker.fusion import may_fuse
from pepsi.worker.outcomes import FINISH, Decision
from pepsi.worker.writes import outcome_word

BUILTIN = StageConfig("b", handler="pepsi.stages.set_:run", builtin="set")


def test_the_decorator_marks_a_transactional_stage() -> None:
    @stage(transactional=True)
    def plain(msg: Message) -> None: ...

    @stage(needs="body", transactional=True)
    def positional(msg: Message) -> None: ...

    @stage(needs=Needs.HEADER, transactional=True)
    async def keyword(msg: Message) -> None: ...

    @stage
    def bare(msg: Message) -> None: ...

    @stage(needs="body")
    def body(msg: Message) -> None: ...

    assert [is_transactional(f) for f in (plain, positional, keyword, bare, body)] == [
        True, True, True, False, False,
    ]  # fmt: skip
    assert [needs_of(f) for f in (plain, positional, keyword)] == [
        Needs.METADATA, Needs.BODY, Needs.HEADER,
    ]  # fmt: skip
    assert not is_transactional(lambda msg: None)


def test_msg_db_outside_a_transactional_stage_raises() -> None:
    msg = Message(1, "a", datetime.now(UTC), StageConfig("a", handler="m:f"))
    with pytest.raises(PepsiError, match="transactional=True"):
        msg.db  # noqa: B018  # the property is the test
    assert "db" not in repr(msg) or "_db" not in repr(msg)


def test_no_fusion_into_a_transactional_stage() -> None:
    args = {
        "loaded": Needs.METADATA,
        "needs": Needs.METADATA,
        "depth": 1,
        "refused": False,
        "changed": False,
        "overridden": False,
    }
    assert may_fuse(BUILTIN, **args)  # type: ignore[arg-type]
    assert not may_fuse(BUILTIN, **args, transactional=True)  # type: ignore[arg-type]


def test_each_decision_is_one_outcome_of_the_sql_function() -> None:
    until = datetime(2030, 1, 1, tzinfo=UTC)
    assert outcome_word(FINISH) == "finish"
    assert outcome_word(Decision("advance", "b", "pending", {})) == "advance"
    assert outcome_word(Decision("pause", "a", "paused", {}, until)) == "pause"
    assert outcome_word(Decision("retry", "a", "paused", {}, until, "boom")) == "pause"
    assert outcome_word(Decision("fail", "a", "failed", {}, error="bad")) == "fail"
