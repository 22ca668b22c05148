"""Which consumer outcomes the AMQP deliverer writes at once, and which wait a moment for
more (pepsi.amqp.broker.consume.outcomes.worth_gathering)."""

from __future__ import annotations

from pepsi.amqp.broker.consume.outcomes import SETTLE_GATHER_ROWS, Outcomes, worth_gathering

STAGE = "amqp:/:q"


def acks(n: int) -> Outcomes:
    return Outcomes(acked=[(STAGE, wid) for wid in range(n)])


def test_a_few_acks_wait_for_more() -> None:
    assert worth_gathering(acks(2), awaited=False, closing=False)


def test_many_acks_are_written_at_once() -> None:
    assert not worth_gathering(acks(SETTLE_GATHER_ROWS), awaited=False, closing=False)


def test_a_returned_or_dead_lettered_message_goes_at_once() -> None:
    for other in (
        Outcomes(returned=[(STAGE, 9)]),
        Outcomes(unsent=[(STAGE, 9)]),
        Outcomes(dead=[(STAGE, 9, "rejected")]),
    ):
        other.acked = acks(2).acked
        assert not worth_gathering(other, awaited=False, closing=False), other


def test_nothing_waits_when_a_flush_awaits_the_write_or_the_deliverer_stops() -> None:
    assert not worth_gathering(acks(2), awaited=True, closing=False)
    assert not worth_gathering(acks(2), awaited=False, closing=True)
