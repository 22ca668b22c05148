"""Pure parts of the AMQP publish path: confirm grouping, the rows' split by queue limit,
and the properties copied into columns."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pika.spec import BasicProperties

from pepsi.amqp.broker.publish.columns import column_peer, column_text, routing_json
from pepsi.amqp.broker.publish.confirms import Confirm, group_confirms
from pepsi.amqp.broker.publish.params import lean_params, split
from pepsi.amqp.broker.publish.properties import parse_expiration, read_properties
from pepsi.amqp.broker.publish.units import Item, Unit, rows_per_stage
from pepsi.amqp.wire.properties import decode_properties
from pepsi.amqp.wire.replies import ChannelError
from pepsi.publishing.message import Row


def test_contiguous_runs_become_multiple_acks() -> None:
    outcomes = [(1, True), (2, True), (3, True), (4, False), (5, True), (6, True)]
    plan, floor = group_confirms(0, outcomes)
    assert plan == [Confirm(True, 3, True), Confirm(False, 4, False), Confirm(True, 6, True)]
    assert floor == 6


def test_a_gap_before_a_run_means_single_confirms() -> None:
    plan, floor = group_confirms(2, [(5, True), (6, True)])  # 3 and 4 still open
    assert plan == [Confirm(True, 5, False), Confirm(True, 6, False)]
    assert floor == 2


def test_later_batches_continue_from_the_floor() -> None:
    plan, floor = group_confirms(10, [(12, True), (11, True)])
    assert plan == [Confirm(True, 12, True)]
    assert floor == 12


def expand(plan: list[Confirm], settled_through: int, open_tags: set[int]) -> dict[int, bool]:
    """What a client concludes from the plan: multiple settles every open tag up to it."""
    outcome: dict[int, bool] = {}
    for confirm in plan:
        tags = (
            [t for t in sorted(open_tags) if t <= confirm.tag and t not in outcome]
            if confirm.multiple
            else [confirm.tag]
        )
        for tag in tags:
            assert tag not in outcome
            outcome[tag] = confirm.ok
    return outcome


@given(
    st.integers(0, 20),
    st.lists(st.tuples(st.integers(1, 40), st.booleans()), unique_by=lambda x: x[0]),
    st.sets(st.integers(1, 40)),
)
def test_the_plan_confirms_exactly_the_settled_tags(
    floor: int, raw: list[tuple[int, bool]], other_open: set[int]
) -> None:
    outcomes = [(floor + tag, ok) for tag, ok in raw]
    settled = {tag for tag, _ in outcomes}
    # tags above the floor that are open but not settled now must never be confirmed
    open_tags = settled | {floor + t for t in other_open}
    plan, new_floor = group_confirms(floor, outcomes)
    # a multiple confirm is only sent when no unsettled tag precedes it
    unsettled = open_tags - settled
    for confirm in plan:
        if confirm.multiple:
            assert not any(t <= confirm.tag for t in unsettled)
    # ... which holds when the other open tags are all above the settled ones
    if all(t > max(settled, default=0) for t in unsettled):
        assert expand(plan, floor, open_tags) == dict(outcomes)
    assert new_floor >= floor
    assert len(plan) <= len(outcomes)


def row(stage: str) -> Row:
    return Row(stage, None, False, None, None, None, None, None, None, None, None, None, None,
               b"h", b"b")  # fmt: skip


def test_split_keeps_reject_publish_stages_apart() -> None:
    a = Item([row("free"), row("full")], {"full": (1, False)})
    b = Item([row("dh")], {"dh": (5, True)})
    a.refused = True
    free, limits, guarded = split([a, b])
    assert [r.stage for r in free] == ["free", "dh"]
    assert limits == {"dh": (5, True)}
    assert list(guarded) == ["full"]
    assert guarded["full"][0][0] is a
    assert a.refused is False


def test_a_commit_counts_the_rows_of_stages_without_a_limit_or_dedup() -> None:
    unlimited = Item([row("reply"), row("tasks")])
    limited = Item([row("reply"), row("capped")], {"capped": (2, True)})
    deduplicated = Item([row("reply"), row("tasks")._replace(message_id="m", dedup=True)])
    units = [Unit([unlimited, limited], lambda *_: None), Unit([deduplicated], lambda *_: None)]
    # the publish function may drop or refuse a limited stage's rows, or skip a duplicate
    assert rows_per_stage(units) == {"reply": 3, "tasks": None, "capped": None}
    assert rows_per_stage([]) == {}


def test_lean_params_are_the_columns_a_publish_fills() -> None:
    rows = [
        Row("q", "m-1", False, None, None, "alice", "192.0.2.1", None, None, "text/plain",
            "c-1", '{"exchange": ""}', None, b"h1", b"b1"),
        Row("r", None, False, None, None, None, "::1", None, None, None, None, None, None,
            None, b""),
    ]  # fmt: skip
    assert lean_params(rows) == (
        ["q", "r"], ["m-1", None], ["alice", None], ["192.0.2.1", "::1"],
        ["text/plain", None], ["c-1", None], ['{"exchange": ""}', None], [None, None],
        [b"h1", None], [b"b1", b""], None,  # priorities: all 0, NULL
        None,  # none written running (direct delivery)
    )  # fmt: skip
    prioritised = [rows[0]._replace(priority=5), rows[1]]
    assert lean_params(prioritised)[-2] == [5, 0]  # type: ignore[index]
    assert lean_params(rows, [False, True])[-1] == [False, True]  # type: ignore[index]
    assert lean_params(rows, [False, False])[-1] is None  # type: ignore[index]


@pytest.mark.parametrize("field", ["dedup", "sender", "recipients", "header_from", "subject"])
def test_lean_params_refuse_what_only_the_general_function_takes(field: str) -> None:
    value = True if field == "dedup" else "x"
    rows = [row("q"), row("q")._replace(**{field: value})]
    assert lean_params(rows) is None


def test_expiration_is_milliseconds_as_text() -> None:
    assert parse_expiration(None) is None
    assert parse_expiration("60000") == 60000
    assert parse_expiration(b"0") == 0
    with pytest.raises(ChannelError, match="value_negative"):
        parse_expiration("-1")
    with pytest.raises(ChannelError, match="value_too_large"):
        parse_expiration(str(10**18))  # RabbitMQ's bound: ten years
    with pytest.raises(ChannelError, match="invalid expiration 'soon'"):
        parse_expiration("soon")


def test_columns_take_only_what_postgresql_can_store() -> None:
    assert column_text("order-7") == "order-7"
    assert column_text(b"order-7") == "order-7"
    assert column_text("a\x00b") is None
    assert column_text(b"\xff") is None
    assert column_text("x" * 5000) is None
    assert column_text(7) is None
    assert column_peer("::1") == "::1"
    assert column_peer("not an address") is None
    assert column_peer(None) is None
    assert routing_json("x\x00", "k") == '{"exchange": "x", "routing_key": "k"}'


text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)


@given(
    content_type=st.none() | text,
    correlation_id=st.none() | text,
    message_id=st.none() | text,
    user_id=st.none() | text,
    expiration=st.none() | st.integers(0, 10**9).map(str),
    headers=st.none() | st.dictionaries(text, st.integers(-(2**31), 2**31 - 1) | text, max_size=4),
    delivery_mode=st.none() | st.sampled_from([1, 2]),
    timestamp=st.none() | st.integers(0, 2**40),
    app_id=st.none() | text,
)
def test_read_properties_agrees_with_pamqp(**fields: Any) -> None:
    if any(isinstance(v, str) and len(v.encode()) > 255 for v in fields.values()):
        return  # not a shortstr
    raw = b"".join(BasicProperties(**fields).encode())  # pika's encoding, as a client sends
    read = read_properties(raw)
    full = decode_properties(raw)
    for name in ("content_type", "correlation_id", "message_id", "user_id", "expiration"):
        value = getattr(read, name)
        assert (value.decode() if value is not None else None) == getattr(full, name)
    assert read.decoded_headers() == (full.headers if fields["headers"] is not None else None)


def test_read_properties_refuses_a_truncated_list() -> None:
    raw = b"".join(BasicProperties(content_type="text/plain").encode())
    with pytest.raises(ValueError, match="truncated"):
        read_properties(raw[:-3])
