"""The message page (`/message/{id}`): envelope, state, header and body (their first
64 KiB, as text when UTF-8, else a hex dump), what is known of its way, and repairs."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from aiohttp import web

from pepsi.admin import queue
from pepsi.errors import NoSuchMessage
from pepsi.web.app import Console, console_of
from pepsi.web.pages.stage import move_targets, stage_url

SHOWN = 64 * 1024  # bytes of a header or body the page shows


def hex_dump(data: bytes) -> str:
    lines = []
    for at in range(0, len(data), 16):
        chunk = data[at : at + 16]
        hexes = " ".join(f"{b:02x}" for b in chunk)
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        lines.append(f"{at:08x}  {hexes:<47}  {text}")
    return "\n".join(lines)


def shown(data: bytes | None, size: int | None) -> dict[str, Any] | None:
    """How the page shows a header or body: text or hex, and whether it is cut."""
    if data is None:
        return None
    total = len(data) if size is None else size
    cut = total > len(data)
    text: str | None = None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if cut and e.start >= len(data) - 3 and e.reason == "unexpected end of data":
            text = data[: e.start].decode("utf-8", "strict")  # the cut split a character
    return {
        "size": total,
        "shown": len(data),
        "cut": cut,
        "binary": text is None,
        "text": text if text is not None else hex_dump(data),
    }


def journey(console: Console, item: queue.MessageDetail) -> list[tuple[str, str]]:
    """What is known of the message's way: from its state, and the stages ahead of it."""
    state = item.state or {}
    known: list[tuple[str, str]] = []
    if "split_from" in state:
        known.append(("split from message", str(state["split_from"])))
    if "bounced_from" in state:
        how = f" ({state['bounced_status']})" if state.get("bounced_status") else ""
        known.append(("bounced from stage", f"{state['bounced_from']}{how}"))
    if "failed_stage" in state:
        known.append(("failed at stage", str(state["failed_stage"])))
    for death in state.get("x_death") or []:
        if isinstance(death, dict):
            known.append(("dead-lettered", ", ".join(f"{k}={v}" for k, v in death.items())))
    if "delivery_count" in state:
        known.append(("AMQP deliveries", str(state["delivery_count"])))
    if "routed" in state:
        known.append(("routed", json.dumps(state["routed"])))
    known.append(("now at stage", item.stage))
    ahead, seen = [], {item.stage}
    stage = console.config.stages.get(item.stage)
    while stage is not None and stage.next and stage.next not in seen:
        ahead.append(stage.next)
        seen.add(stage.next)
        stage = console.config.stages.get(stage.next)
    if ahead:
        known.append(("stages ahead (configuration)", " → ".join(ahead)))
    return known


async def message(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    try:
        message_id = int(request.match_info["id"])
    except ValueError:
        message_id = -1
    try:
        item = await console.db(queue.get_message, message_id)
        header, body = await console.db(queue.read_head, message_id, limit=SHOWN)
    except NoSuchMessage as e:
        response = console.render(
            request, "message_missing.html", message_id=request.match_info["id"], error=str(e)
        )
        response.set_status(404)
        return response
    state = dict(item.state or {})
    details = asdict(item)
    for key in ("state", "header", "body", "properties", "header_size", "body_size"):
        details.pop(key)
    return console.render(
        request,
        "message.html",
        item=item,
        details=details,
        properties=json.dumps(item.properties or {}, indent=2, sort_keys=True, default=str),
        state=state,
        state_json=json.dumps(state, indent=2, sort_keys=True, default=str),
        retry_at=item.timeout if item.status == "paused" else None,
        header=shown(header, item.header_size),
        body=shown(body, item.body_size),
        journey=journey(console, item),
        stage_url=stage_url(item.stage),
        targets=move_targets(console, item.stage),
        here=request.path,
        done=request.query.get("done", ""),
    )


def setup(app: web.Application) -> None:
    app.router.add_get("/message/{id}", message)
