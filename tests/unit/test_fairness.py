from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pepsi.dispatch.policy.fairness import DECAY_STEP, FairShare, StageLedger, rank


def test_a_burst_alternates_with_a_lone_sender() -> None:
    pending = {"a": list(range(1, 1001)), "b": [1001]}
    assert rank(pending, {}, average=1.0, cap=4, fifo=0) == [1, 1001, 2, 3]


def test_lag_pushes_a_sender_back() -> None:
    pending = {"a": [1, 2, 3], "b": [4, 5, 6]}
    # a has used 2.5 messages' worth more than b: b goes first
    assert rank(pending, {"a": 2.5}, average=1.0, cap=4, fifo=0) == [4, 5, 6, 1]


def test_fifo_share_takes_the_oldest_whatever_the_sender() -> None:
    pending = {"heavy": [1, 2, 3], "light": [10, 11]}
    chosen = rank(pending, {"heavy": 100.0}, average=1.0, cap=3, fifo=1)
    assert chosen == [1, 10, 11]


@st.composite
def backlogs(draw: st.DrawFn) -> tuple[dict[str, list[int]], dict[str, float], float, int, int]:
    ids = iter(range(1, 10_000))
    senders = draw(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=8, unique=True))
    pending = {s: [next(ids) for _ in range(draw(st.integers(1, 20)))] for s in senders}
    lags = {s: draw(st.floats(0, 50)) for s in senders if draw(st.booleans())}
    cap = draw(st.integers(1, 30))
    return pending, lags, draw(st.floats(0.01, 5)), cap, draw(st.integers(0, cap))


@given(backlogs())
def test_rank_invariants(
    case: tuple[dict[str, list[int]], dict[str, float], float, int, int],
) -> None:
    pending, lags, average, cap, fifo = case
    chosen = rank(pending, lags, average, cap, fifo)
    every = sorted(i for ids in pending.values() for i in ids)
    assert len(chosen) == min(cap, len(every))
    assert len(set(chosen)) == len(chosen)
    assert chosen[: min(fifo, cap)] == every[: min(fifo, cap)]  # the FIFO share
    for ids in pending.values():  # a sender's rows are taken oldest first
        taken = sorted(set(chosen) & set(ids))
        assert taken == sorted(ids)[: len(taken)]


def test_debit_correct_refund() -> None:
    ledger = StageLedger(half_life=60.0, average=1.0)
    ledger.claim(1, "a")
    ledger.claim(2, "a")
    ledger.claim(3, "b")
    assert ledger.lags == {"a": 2.0, "b": 1.0}
    ledger.report(1, 3.0)  # measured 3 s instead of the 1 s debited
    assert ledger.lags["a"] == pytest.approx(4.0)
    assert ledger.average == pytest.approx(1.2)  # learns the stage's average
    ledger.refund(2)  # never ran
    assert ledger.lags["a"] == pytest.approx(3.0)
    ledger.timed_out(3, 30.0)
    assert ledger.lags["b"] == pytest.approx(30.0)
    assert ledger.debits == {}


def test_report_without_measurement_keeps_the_debit() -> None:
    ledger = StageLedger(half_life=60.0, average=2.0)
    ledger.claim(1, "a")
    ledger.report(1, None)
    assert ledger.lags == {"a": 2.0}
    assert ledger.average == 2.0


def test_half_life_forgetting_and_no_credit_for_silence() -> None:
    ledger = StageLedger(half_life=10.0, average=1.0, decayed_at=0.0)
    ledger.lags = {"busy": 9.0, "quiet": 1.0}
    ledger.decay(10.0)  # halved, then levelled on the least served
    assert ledger.lags == {"busy": pytest.approx(4.0)}  # quiet is the least: 0, forgotten
    ledger.decay(40.0)  # 4 -> 0.5, under one message: forgotten
    assert ledger.lags == {}
    # a sender that was silent starts level with the least served, not ahead
    ledger.lags = {"a": 5.0, "b": 3.0}
    ledger.decay(40.0)  # within DECAY_STEP of the last decay: nothing changes yet
    assert ledger.lags == {"a": 5.0, "b": 3.0}
    ledger.decay(40.0 + DECAY_STEP)
    assert ledger.lags == {"a": pytest.approx(2.0, rel=0.01)}
    assert rank({"a": [1], "new": [2]}, ledger.lags, 1.0, 1, 0) == [2]


def test_fifo_credit_carries_fractions() -> None:
    ledger = StageLedger(half_life=60.0)
    slots = [ledger.fifo_slots(cap=4, percent=10) for _ in range(10)]
    assert sum(slots) == 4  # 10 % of 40 slots, spread over the claims
    assert max(slots) == 1


def test_claim_params_are_arrays_per_stage() -> None:
    now = [0.0]
    fair = FairShare(half_life=60.0, fifo_percent=50, clock=lambda: now[0])
    fair.ledger("s").lags = {"x": 3.0, "y": 1.0}
    now[0] = 1.0  # past DECAY_STEP: the lags are decayed and levelled
    params = fair.claim_params({"s": 4, "t": 2})
    assert params["stages"] == ["s", "t"]
    assert params["caps"] == [4, 2]
    assert params["fifo"] == [2, 1]
    # levelled on y, which is forgotten; stage t has no lags at all
    assert params["lags"] == {"s": {"x": pytest.approx(2.0, rel=0.02)}}
    assert params["starts"] == ["", ""]


def test_with_many_senders_a_claim_gets_the_lags_after_its_window_start() -> None:
    ledger = StageLedger(half_life=60.0)
    ledger.lags = {f"s{i:04d}": float(i) for i in range(1000)}
    assert ledger.lags_after("", count=2000) is ledger.lags  # few enough: all of them
    sent = ledger.lags_after("s0500", count=100)
    assert sorted(sent) == [f"s{i:04d}" for i in range(501, 601)]
    assert sent["s0550"] == 550.0
    wrapped = ledger.lags_after("s0950", count=100)  # wraps around to the first
    assert set(wrapped) == {f"s{i:04d}" for i in [*range(951, 1000), *range(51)]}
    ledger.claim(1, "s0500x")  # a new sender: the order is rebuilt
    assert "s0500x" in ledger.lags_after("s0500", count=100)
