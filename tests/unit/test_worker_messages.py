"""The loader builds a Message positionally: its fields must stay in that order."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime

from pepsi.config import StageConfig
from pepsi.stage import Message, Needs
from pepsi.worker.messages import FIELD_ORDER, MessageLoader


def test_message_fields_are_in_the_order_the_loader_passes_them() -> None:
    names = [f.name for f in dataclasses.fields(Message)]
    assert tuple(names[: len(FIELD_ORDER)]) == FIELD_ORDER


def test_a_claimed_row_becomes_the_message_it_describes() -> None:
    """Each column lands in its field (the same path as a loaded row's)."""
    stage = StageConfig(name="s")
    loader = MessageLoader(stage, Needs.METADATA)
    arrived = datetime(2026, 12, 6, 4, 0, tzinfo=UTC)
    # as pepsi.workqueue_claimed_rows returns it: the columns after the id, no body
    # (body_id null), the claim token last
    row = json.dumps([
        "s", arrived.isoformat(), "mid", "a@b.example", ["c@d.example"], "alice",
        "192.0.2.1", "From <a@b.example>", "Hi", "text/plain", "corr",
        {"k": 1}, {"strikes": 1}, "user:alice", None, "tok",
    ]).encode()  # fmt: skip
    msg = loader.from_claim(None, 7, row)  # type: ignore[arg-type]  # no body: no connection
    assert msg is not None
    assert (msg.id, msg.stage, msg.arrived, msg.options) == (7, "s", arrived, stage)
    assert (msg.message_id, msg.sender, msg.recipients) == ("mid", "a@b.example", ("c@d.example",))
    assert (msg.origin_user, msg.origin_peer, msg.header_from, msg.subject) == (
        "alice", "192.0.2.1", "From <a@b.example>", "Hi",
    )  # fmt: skip
    assert (msg.content_type, msg.correlation_id) == ("text/plain", "corr")
    assert (msg.properties, msg.state, msg.sender_key) == ({"k": 1}, {"strikes": 1}, "user:alice")
    assert (msg._header, msg._body, msg._loader, msg._token) == (None, None, None, "tok")
