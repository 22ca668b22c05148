from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pepsi.protocol import (
    OUTCOMES,
    Pass,
    ProtocolError,
    encode_ids,
    format_status,
    is_ready,
    parse_id_line,
    parse_status,
    takes_rows,
)


def test_ids_are_one_buffer_of_lines() -> None:
    assert encode_ids([1, 22, 333]) == b"1\n22\n333\n"
    assert [parse_id_line(line) for line in encode_ids([5, 6]).splitlines()] == [
        (5, None),
        (6, None),
    ]


@pytest.mark.parametrize("line", [b"", b"x\n", b"-1\n", b"1x 2\n", b"1.5\n", b"x [1]\n"])
def test_bad_ids(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_id_line(line)


def test_ready() -> None:
    assert is_ready(b"ready\n")
    assert is_ready(b"ready\r\n")
    assert not is_ready(b"0\n")
    assert is_ready(b"ready rows\n")
    assert takes_rows(b"ready rows\n")
    assert not takes_rows(b"ready\n")
    assert not is_ready(b"ready all\n")


def test_an_id_carries_its_row_only_where_one_is_given() -> None:
    lines = encode_ids([1, 2, 3], {2: b'["s", 1]', 9: b"[]"}).splitlines()
    assert lines == [b"1", b'2 ["s", 1]', b"3"]
    assert [parse_id_line(line) for line in lines] == [(1, None), (2, b'["s", 1]'), (3, None)]
    assert encode_ids([4], {}) == b"4\n"


def test_status_without_report() -> None:
    line = parse_status(b"0\n")
    assert line.ok
    assert line.report is None
    assert line.report_error is None
    assert parse_status(b"75\n").status == 75


def test_status_with_report() -> None:
    line = parse_status(b'0 [["a",120],["b",30]]\n')
    assert line.report == (Pass("a", 120), Pass("b", 30))


def test_report_names_outcomes_and_ignores_unknown_ones() -> None:
    line = parse_status(b'0 [["a",120,"advance"],["b",30,"teleport"]]\n')
    assert line.report == (Pass("a", 120, "advance"), Pass("b", 30, None))


@pytest.mark.parametrize(
    "report",
    [
        b"{not json",
        b'{"a":1}',
        b'[["a"]]',
        b'[["a",-1]]',
        b'[["a",1.5]]',
        b"[[1,2]]",
        b'[["a",true]]',
        b'[["a",1,2]]',
        b'[["a",1,"finish","x"]]',
        b'[["a",012]]',
        b'[["\xff",1]]',
        b'[["a",1,"\xff"]]',
    ],
)
def test_unreadable_report_is_dropped_not_fatal(report: bytes) -> None:
    line = parse_status(b"0 " + report + b"\n")
    assert line.ok
    assert line.report is None
    assert line.report_error is not None


@pytest.mark.parametrize("line", [b"\n", b"ok\n", b"0x1\n", b" 0\n", b"99999999999\n"])
def test_unreadable_status_is_fatal(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_status(line)


@given(
    st.integers(min_value=-(10**8), max_value=10**8),
    st.none()
    | st.lists(
        st.builds(
            Pass,
            st.text(alphabet="abcdefghijklmnopqrstuvwxyz-_0123456789", min_size=1, max_size=20),
            st.integers(min_value=0, max_value=10**12),
            st.none() | st.sampled_from(sorted(OUTCOMES)),
        ),
        max_size=5,
    ),
)
def test_status_round_trips(status: int, report: list[Pass] | None) -> None:
    line = parse_status(format_status(status, report))
    assert line.status == status
    assert line.report == (None if report is None else tuple(report))


@given(
    st.integers(min_value=-(10**8), max_value=10**8),
    st.text(max_size=12),
    st.integers(min_value=0, max_value=10**15),
    st.none() | st.text(max_size=8) | st.sampled_from(sorted(OUTCOMES)),
)
def test_a_one_pass_line_reads_as_its_json(
    status: int, stage: str, micros: int, outcome: str | None
) -> None:
    """The one-pass line's own reader agrees with JSON's, whatever the names hold."""
    entry = [stage, micros] if outcome is None else [stage, micros, outcome]
    for text in (
        json.dumps([entry], separators=(",", ":")),
        json.dumps([entry], ensure_ascii=False),
    ):
        line = parse_status(b"%d %s\n" % (status, text.encode()))
        known = outcome if outcome in OUTCOMES else None
        assert line == (status, (Pass(stage, micros, known),), None)


def test_the_workers_json_loader_skips_the_empty_object() -> None:
    from pepsi.worker.runtime import _loads_json  # noqa: PLC0415

    first, second = _loads_json(b"{}"), _loads_json("{}")
    assert first == second == {}
    first["x"] = 1
    assert second == {}  # never a shared object
    assert _loads_json(b'{"strikes": 2}') == {"strikes": 2}
