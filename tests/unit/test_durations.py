from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pepsi.durations import format_duration, format_seconds, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30.0),
        ("30s", 30.0),
        ("5m", 300.0),
        ("120h", 432000.0),
        ("1d", 86400.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        (" 2M ", 120.0),
        ("1.5s", 1.5),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "s", "5x", "5m junk", "m5", "-5s", "5m5m", "1h 2q"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@given(st.integers(min_value=0, max_value=10**7))
def test_format_round_trips(seconds: int) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


def test_log_delays_under_a_second_are_not_rounded_to_zero() -> None:
    assert format_seconds(0.5) == "500ms"
    assert format_seconds(0.0004) == "1ms"
    assert format_seconds(0) == "0s"
    assert format_seconds(1.0) == "1s"
    assert format_seconds(1.5) == "1.5s"
    assert format_seconds(60.0) == "60s"
    assert format_seconds(3600.0) == "3600s"
