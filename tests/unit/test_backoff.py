"""The reconnect backoff (`pepsi.db.backoff`): pure, its jitter injected."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pepsi.config import DispatchOptions
from pepsi.db.backoff import DEFAULT_CAP, FIRST_DELAY, Backoff


def first(backoff: Backoff, n: int, rng: float) -> list[float]:
    return list(itertools.islice(backoff.delays(lambda: rng), n))


def test_nominal_delays_double_from_100ms_to_the_cap() -> None:
    # rng → 1 gives the nominal delay; the cap is RECONNECT_MAX_DELAY's default, 1 s
    assert first(Backoff(), 7, 0.999999) == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0], abs=1e-5
    )


def test_the_jitter_halves_at_most() -> None:
    assert first(Backoff(), 5, 0.0) == pytest.approx([0.05, 0.1, 0.2, 0.4, 0.5])


def test_a_cap_below_the_first_delay_is_every_delay() -> None:
    assert first(Backoff(cap=0.05), 3, 0.999999) == pytest.approx([0.05] * 3, abs=1e-5)


def test_the_default_cap_is_the_configuration_default() -> None:
    assert DEFAULT_CAP == DispatchOptions().reconnect_max_delay == 1.0
    assert Backoff().cap == DEFAULT_CAP
    assert FIRST_DELAY == 0.1


def test_each_series_starts_afresh() -> None:
    backoff = Backoff(cap=30.0)
    assert first(backoff, 3, 0.5) == first(backoff, 3, 0.5)


@pytest.mark.parametrize(("cap", "start"), [(0.0, 0.1), (1.0, 0.0), (-1.0, 0.1)])
def test_a_zero_or_negative_delay_is_refused(cap: float, start: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        Backoff(cap=cap, first=start)


@given(
    cap=st.floats(0.001, 3600.0),
    start=st.floats(0.001, 60.0),
    draws=st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=40),
)
def test_every_delay_lies_in_half_to_whole_of_a_doubling_capped_nominal(
    cap: float, start: float, draws: list[float]
) -> None:
    rng = iter(draws)
    delays = list(itertools.islice(Backoff(cap, start).delays(lambda: next(rng)), len(draws)))
    nominal = min(start, cap)
    for delay in delays:
        assert nominal / 2 <= delay <= nominal
        assert delay <= cap  # never longer than RECONNECT_MAX_DELAY: Pepsi's share of an outage
        nominal = min(cap, nominal * 2)
