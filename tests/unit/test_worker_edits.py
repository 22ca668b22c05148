"""What a stage changed in its message (issue 32): the snapshot taken before it runs."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

from hypothesis import given
from hypothesis import strategies as st

from pepsi.config import StageConfig
from pepsi.stage import Message
from pepsi.worker import edits

NOW = datetime(2026, 1, 1, tzinfo=UTC)

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


def message(properties: dict[str, object]) -> Message:
    return Message(id=1, stage="a", arrived=NOW, options=StageConfig("a"), properties=properties)


@given(JSON)
def test_a_copy_of_json_data_is_equal_and_shares_no_container(value: object) -> None:
    copied = edits.copy_json(value)
    assert copied == value

    def containers(v: object) -> list[object]:
        inner = v.values() if isinstance(v, dict) else v if isinstance(v, list) else []
        own = [v] if isinstance(v, dict | list) else []
        return own + [c for item in inner for c in containers(item)]

    original = {id(c) for c in containers(value)}
    assert original.isdisjoint(id(c) for c in containers(copied))


def test_anything_else_a_stage_put_there_is_copied_deeply() -> None:
    mutable = {"amounts": [Decimal("1.5")], "seen": {1, 2}}
    copied = edits.copy_json({"x": mutable["seen"], "y": mutable})
    assert copied == {"x": {1, 2}, "y": mutable}
    assert copied["x"] is not mutable["seen"]
    assert copied["y"]["seen"] is not mutable["seen"]


def test_a_nested_change_shows_and_a_failed_stage_leaves_the_message_as_it_was() -> None:
    msg = message({"smtp": {"ret": None, "notify": {"a@x.org": ["FAILURE"]}}})
    loaded = edits.snapshot(msg)
    assert not edits.changed(msg, loaded)
    msg.properties["smtp"]["notify"]["a@x.org"].append("SUCCESS")  # in place, nested
    assert edits.changed(msg, loaded)
    found = edits.edits(msg, loaded)
    assert found is not None
    assert list(found.columns) == ["properties"]
    edits.restore(msg, loaded)
    assert msg.properties == {"smtp": {"ret": None, "notify": {"a@x.org": ["FAILURE"]}}}
    assert not edits.changed(msg, loaded)
    msg.properties["smtp"]["ret"] = "HDRS"  # the restored copy is not the snapshot's
    assert loaded.values[-1]["smtp"]["ret"] is None
