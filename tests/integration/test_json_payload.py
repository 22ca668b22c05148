"""A structured payload end to end: `publish(json=...)` to `Message.json()` (issue 13).

Published through the real publisher, loaded by the worker's own message
loader (both with the body declared and lazily), then run through
`pepsi.testing.run_stage`, which makes the worker's decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi import Message, Needs, Outcome, PermanentError, stage
from pepsi.publishing import AsyncPublisher, InvalidMessage, OutgoingMessage, Publisher
from pepsi.testing import run_stage
from pepsi.worker.messages import MessageLoader

Conn = psycopg.Connection[tuple[Any, ...]]
CONF = "[stage-orders]\nHANDLER = tests.stages:noop\nNEXT = done\n[stage-done]\nHANDLER = tests.stages:noop\n"
ORDER = {"id": 7, "lines": [{"sku": "é-1", "qty": 2}], "note": None, "paid": True}


@pytest.fixture
def pub(tmp_path: Path, dsn: str) -> Iterator[Publisher]:
    conf = tmp_path / "pepsi.conf"
    conf.write_text(CONF)
    with Publisher.connect(conf, dsn) as publisher:
        yield publisher


def load(pub: Publisher, conn: Conn, wid: int, needs: Needs) -> Message:
    conn.execute("UPDATE pepsi.workqueue SET status = 'running' WHERE workqueue_id = %s", (wid,))
    loader = MessageLoader(pub.config.stages["orders"], needs)
    return loader.load(conn, [wid])[wid]


@stage(needs="body")
def total(msg: Message) -> Outcome:
    order = msg.json()
    msg.state["items"] = sum(line["qty"] for line in order["lines"])
    return msg.advance()


@pytest.mark.parametrize("needs", [Needs.BODY, Needs.METADATA])  # declared, or loaded lazily
def test_json_published_is_json_received(pub: Publisher, conn: Conn, needs: Needs) -> None:
    wid = pub.publish("orders", json=ORDER, message_id="o-7")
    msg = load(pub, conn, wid, needs)
    assert msg.content_type == "application/json"
    assert msg.json() == ORDER
    assert msg.body == '{"id":7,"lines":[{"sku":"é-1","qty":2}],"note":null,"paid":true}'.encode()
    ran = run_stage(total, msg, stages=pub.config.stages)
    assert (ran.outcome, ran.stage, ran.state) == ("advance", "done", {"items": 2})


def test_json_keeps_a_content_type_given_and_works_in_batches_and_async(
    pub: Publisher, conn: Conn, dsn: str
) -> None:
    ids = pub.publish_many(
        [
            OutgoingMessage("orders", json=[1, 2], content_type="application/vnd.x+json"),
            OutgoingMessage("orders", json="text"),
        ]
    )
    first, second = (load(pub, conn, wid, Needs.BODY) for wid in ids)
    assert (first.content_type, first.json()) == ("application/vnd.x+json", [1, 2])
    assert (second.content_type, second.json()) == ("application/json", "text")

    async def publish_async() -> int:
        async with AsyncPublisher(pub.base, dsn) as apub:
            return await apub.publish("orders", json={"async": True})

    assert load(pub, conn, asyncio.run(publish_async()), Needs.BODY).json() == {"async": True}


def test_json_refusals(pub: Publisher) -> None:
    with pytest.raises(InvalidMessage, match="give body= or json=, not both"):
        pub.publish("orders", b"x", json={})
    with pytest.raises(InvalidMessage, match="json= is not JSON"):
        pub.publish("orders", json={"when": object()})
    with pytest.raises(InvalidMessage, match="json= is not JSON"):
        pub.publish("orders", json=float("nan"))  # jsonb and most parsers refuse NaN


def test_a_body_that_is_not_json_fails_the_message_permanently(pub: Publisher, conn: Conn) -> None:
    msg = load(pub, conn, pub.publish("orders", b"\xff not json"), Needs.BODY)
    with pytest.raises(PermanentError, match="body is not JSON"):
        msg.json()
    ran = run_stage(total, msg, stages=pub.config.stages)
    assert (ran.outcome, ran.status, ran.state["failure_class"]) == ("fail", "failed", "permanent")
    empty = load(pub, conn, pub.publish("orders"), Needs.BODY)
    with pytest.raises(PermanentError, match="no body"):
        empty.json()
