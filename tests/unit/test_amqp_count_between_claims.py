"""count_between_claims: a queue's pending rows counted while no claim moves them."""

from __future__ import annotations

import asyncio

from pepsi.amqp.broker.consume.state import COUNT_TRIES, NoDispatch, count_between_claims


class Claims(NoDispatch):
    """The dispatcher's claims as the link shows them: `overlaps` claims run during the
    first counts, one each."""

    def __init__(self, overlaps: int) -> None:
        self.turn = 0
        self.overlaps = overlaps
        self.waits = 0

    def claim_turn(self) -> int:
        return self.turn

    async def between_claims(self) -> int:
        self.waits += 1
        return self.turn


def counted(claims: Claims) -> tuple[int, int]:
    """The count's result, and how many times it was taken."""
    calls = 0

    async def count() -> int:
        nonlocal calls
        calls += 1
        if claims.overlaps:
            claims.overlaps -= 1
            claims.turn += 2  # a claim ran meanwhile
        return 10 * calls

    return asyncio.run(count_between_claims(claims, count)), calls


def test_a_count_no_claim_overlapped_is_taken_once() -> None:
    claims = Claims(0)
    assert counted(claims) == (10, 1)
    assert claims.waits == 1


def test_a_count_a_claim_overlapped_is_taken_again() -> None:
    assert counted(Claims(1)) == (20, 2)
    assert counted(Claims(2)) == (30, 3)


def test_claims_that_keep_overlapping_leave_the_last_count() -> None:
    assert counted(Claims(99)) == (10 * COUNT_TRIES, COUNT_TRIES)
