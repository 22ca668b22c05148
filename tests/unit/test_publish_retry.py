"""The retry decision of the publish API (Q-3): pure, no database."""

from __future__ import annotations

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg_pool import PoolTimeout

from pepsi.errors import (
    DatabaseBusy,
    DatabaseLost,
    DatabaseReadOnly,
    DatabaseUnavailable,
    InvalidMessage,
    NotConfirmed,
    PublishFailed,
    Rejected,
    is_unwritten,
)
from pepsi.publishing import OutgoingMessage, Retry
from pepsi.publishing.retry import (
    Attempts,
    Failure,
    all_deduplicated,
    decide,
    failure,
    idempotent,
    policy,
)


def _pg(sqlstate: str | None, text: str = "boom") -> psycopg.Error:
    cls = psycopg.errors.lookup(sqlstate) if sqlstate else psycopg.OperationalError
    return cls(text)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (PoolTimeout("couldn't get a connection after 1.00 sec"), Failure.NOT_WRITTEN),
        (DatabaseBusy("too many clients"), Failure.NOT_WRITTEN),
        (_pg("53300"), Failure.NOT_WRITTEN),
        (_pg("25006"), Failure.NOT_WRITTEN),  # a read-only node: the statement never ran
        (DatabaseReadOnly("not the primary"), Failure.NOT_WRITTEN),
        (
            psycopg.OperationalError("FATAL: the database system is in recovery mode"),
            Failure.NOT_WRITTEN,
        ),
        (DatabaseUnavailable("cannot connect"), Failure.NOT_WRITTEN),
        (NotConfirmed("lost before the confirm"), Failure.UNKNOWN),
        (DatabaseLost("connection lost"), Failure.UNKNOWN),
        (_pg("57P01"), Failure.UNKNOWN),
        (_pg(None, "server closed the connection unexpectedly"), Failure.UNKNOWN),
        (Rejected("stage full"), Failure.FINAL),
        (InvalidMessage("bad"), Failure.FINAL),
        (PublishFailed("statement timeout", "57014"), Failure.FINAL),
        (_pg("57014"), Failure.FINAL),  # a cancel is not the connection's fault
        (ValueError("a bug"), Failure.FINAL),
    ],
)
def test_failures_are_classified_at_the_one_boundary(error: BaseException, kind: Failure) -> None:
    assert failure(error) is kind
    assert is_unwritten(error) is (kind is Failure.NOT_WRITTEN)


RULE = Retry(deadline=10.0, attempts=5, max_delay=1.0)


def test_not_written_is_retried_even_without_dedup() -> None:
    pause = decide(RULE, DatabaseBusy("x"), attempt=1, elapsed=0.0, delay=0.1, idempotent=False)
    assert pause == 0.1


def test_an_unknown_outcome_is_retried_only_under_dedup() -> None:
    lost = NotConfirmed("x")
    assert decide(RULE, lost, attempt=1, elapsed=0.0, delay=0.1, idempotent=True) == 0.1
    assert decide(RULE, lost, attempt=1, elapsed=0.0, delay=0.1, idempotent=False) is None


def test_final_errors_are_never_retried() -> None:
    for error in (Rejected("full"), InvalidMessage("bad"), RuntimeError("bug")):
        assert decide(RULE, error, attempt=1, elapsed=0.0, delay=0.1, idempotent=True) is None


def test_the_attempt_count_bounds_the_retries() -> None:
    busy = DatabaseBusy("x")
    assert decide(RULE, busy, attempt=4, elapsed=0.0, delay=0.1, idempotent=True) == 0.1
    assert decide(RULE, busy, attempt=5, elapsed=0.0, delay=0.1, idempotent=True) is None


def test_the_deadline_bounds_the_retries() -> None:
    busy = DatabaseBusy("x")
    assert decide(RULE, busy, attempt=1, elapsed=9.0, delay=0.5, idempotent=True) == 0.5
    assert decide(RULE, busy, attempt=1, elapsed=9.6, delay=0.5, idempotent=True) is None


def test_an_attempt_that_already_waited_is_not_made_to_wait_again() -> None:
    busy = DatabaseBusy("pool timeout")
    assert decide(RULE, busy, attempt=2, elapsed=3, delay=0.8, spent=0.5, idempotent=True) == (
        pytest.approx(0.3)
    )
    assert decide(RULE, busy, attempt=2, elapsed=3, delay=0.8, spent=1.0, idempotent=True) == 0


@given(
    attempt=st.integers(1, 100),
    elapsed=st.floats(0, 100),
    delay=st.floats(0, 5),
    spent=st.floats(0, 10),
    unknown=st.booleans(),
    idem=st.booleans(),
)
def test_a_retry_never_passes_the_deadline_or_the_count(
    attempt: int, elapsed: float, delay: float, spent: float, unknown: bool, idem: bool
) -> None:
    error = NotConfirmed("x") if unknown else DatabaseBusy("x")
    pause = decide(
        RULE, error, attempt=attempt, elapsed=elapsed, delay=delay, spent=spent, idempotent=idem
    )
    if pause is not None:
        assert 0 <= pause <= delay
        assert elapsed + pause < RULE.deadline
        assert RULE.attempts is not None
        assert attempt < RULE.attempts
        assert idem or not unknown


def test_the_retry_option_resolves_against_the_publishers() -> None:
    mine = Retry(attempts=3)
    assert policy(None, None) is None
    assert policy(None, mine) is mine
    assert policy(False, mine) is None
    assert policy(True, None) == Retry()
    assert policy(mine, None) is mine
    with pytest.raises(TypeError):
        policy(3, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"deadline": 0}, {"attempts": 0}, {"max_delay": 0}, {"deadline": -1.0}]
)
def test_a_retry_rule_must_make_sense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="Retry"):
        Retry(**kwargs)  # type: ignore[arg-type]


def test_messages_without_an_id_get_one_under_dedup_before_the_first_attempt() -> None:
    ids = iter(["g1", "g2"])
    given_id = OutgoingMessage("a", b"1", message_id="mine", dedup=True)
    own_no_dedup = OutgoingMessage("a", b"2", message_id="theirs")
    bare = OutgoingMessage("a", b"3", subject="s")
    out = idempotent([given_id, own_no_dedup, bare], make_id=lambda: next(ids))
    assert out[0] is given_id
    assert out[1] is own_no_dedup  # the caller's id, the caller's dedup
    assert (out[2].message_id, out[2].dedup, out[2].subject, out[2].body) == ("g1", True, "s", b"3")
    assert not all_deduplicated(out)
    assert all_deduplicated([out[0], out[2]])


def test_generated_ids_are_unique() -> None:
    out = idempotent([OutgoingMessage("a", b"x") for _ in range(100)])
    assert len({m.message_id for m in out}) == 100


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_attempts_track_count_deadline_and_the_time_spent() -> None:
    clock = Clock()
    tries = Attempts(
        Retry(deadline=5.0, max_delay=1.0), idempotent=True, clock=clock, rng=lambda: 1.0
    )
    tries.begin()
    clock.now += 0.02  # a fast failure: the rest of the first delay (0.1)
    assert tries.failed(NotConfirmed("x")) == pytest.approx(0.08)
    clock.now += 0.1
    tries.begin()
    clock.now += 0.5  # waited for the pool longer than the next delay (0.2): no pause
    assert tries.failed(DatabaseBusy("x")) == 0
    assert tries.remaining() == pytest.approx(5.0 - 0.62)
    clock.now += 10
    tries.begin()
    assert tries.remaining() == 0
    assert tries.failed(DatabaseBusy("x")) is None
