"""Loading the rows a worker was handed as `Message`s: one SELECT per batch.

A stage gets what it declared (`@stage(needs=...)`): metadata only, the
header block too, or the header and the body. What it did not declare is
loaded on first access, with one more SELECT. A metadata-only stage's rows may
come with their ids instead (a small claim returns them, `from_claim`): those
are not loaded at all. Rows with content are read in
binary: as text, a bytea is hex, twice its size, encoded by the server and
decoded here (a one-row load of a 28 KB message: 170 µs of CPU on both sides,
110 in binary).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pepsi.config import StageConfig
from pepsi.db.queries import number_array, query, query_text
from pepsi.stage import BodyLoader, Message, Needs

Conn = psycopg.Connection[tuple[Any, ...]]
# A header block or body loaded with its row when it is at most this big; a
# larger one on its own, when the stage first reads it. A batch of QUEUE_LIMIT
# messages so holds at most QUEUE_LIMIT x 2 x INLINE bytes of content.
INLINE = 256 * 1024
# Message's first fields, in the order `_message` passes them.
FIELD_ORDER = (
    "id", "stage", "arrived", "options", "message_id", "sender", "recipients", "origin_user",
    "origin_peer", "header_from", "subject", "content_type", "correlation_id", "properties",
    "state", "sender_key", "_header", "_body", "_loader", "_token",
)  # fmt: skip


@dataclass
class WithSettings:
    """Loaded messages, the overrides of those that have any ({address: options}),
    and whether the stage has any override left at all."""

    messages: dict[int, Message]
    overrides: dict[int, dict[str, dict[str, str]]]
    any_override: bool


class MessageLoader:
    """Turns ids into the messages still running at one stage, as the stage needs them."""

    def __init__(self, stage: StageConfig, needs: Needs) -> None:
        self.stage = stage
        self.needs = needs

    def _params(self, ids: list[int]) -> dict[str, Any]:
        return {
            "ids": number_array(ids),  # a literal: see pepsi.db.queries
            "stage": self.stage.name,
            "with_header": self.needs is not Needs.METADATA,
            "with_body": self.needs is Needs.BODY,
            "inline": INLINE,
        }

    def load(
        self, conn: Conn, ids: list[int], given: Mapping[int, bytes] | None = None
    ) -> dict[int, Message]:
        """The rows among `ids` still running at the stage (a repair may have moved one);
        for a metadata-only stage, those `given` with their ids as they are."""
        if self.needs is Needs.METADATA:  # no content: one generic plan (schema 26)
            messages: dict[int, Message] = {}
            if given:
                for wid in ids:
                    row = given.get(wid)
                    msg = None if row is None else self.from_claim(conn, wid, row)
                    if msg is not None:
                        messages[wid] = msg
                ids = [wid for wid in ids if wid not in messages]
                if not ids:
                    return messages
            params = {"ids": number_array(ids), "stage": self.stage.name}
            rows = conn.execute(query_text("workqueue_load_metadata"), params).fetchall()
            messages.update((int(row[0]), self._message(conn, row)) for row in rows)
            return messages
        load = query_text("workqueue_load_running")
        rows = conn.execute(load, self._params(ids), binary=True).fetchall()
        return {int(row[0]): self._message(conn, row) for row in rows}

    def from_claim(self, conn: Conn, wid: int, row: bytes) -> Message | None:
        """A row as the claim returned it (pepsi.workqueue_claimed_rows: a JSON array of
        workqueue_load_metadata's columns after the id); None if it cannot be read as
        one of this stage's, and the row is loaded instead."""
        try:
            fields = json.loads(row)
            if not isinstance(fields, list) or len(fields) != 16 or fields[0] != self.stage.name:
                return None
            fields[1] = datetime.fromisoformat(fields[1])  # arrived
        except (ValueError, TypeError):
            return None
        # as workqueue_load_metadata's row: no header, no body, not deferred, the token last
        return self._message(conn, (wid, *fields[:15], None, None, False, fields[15]))

    def load_with_settings(self, conn: Conn, ids: list[int]) -> WithSettings:
        """As `load`, with each row's per-address overrides at the stage (W-9), same query."""
        rows = conn.execute(
            query("workqueue_load_running_with_settings"), self._params(ids), binary=True
        ).fetchall()
        # No row loaded says nothing of the settings: assume overrides remain.
        loaded = WithSettings({}, {}, any_override=bool(rows[0][20]) if rows else True)
        for row in rows:
            wid = int(row[0])
            loaded.messages[wid] = self._message(conn, row)
            if row[19]:
                loaded.overrides[wid] = row[19]
        return loaded

    def _message(self, conn: Conn, row: tuple[Any, ...]) -> Message:
        (wid, stage, arrived, message_id, sender, recipients, user, peer, header_from,
         subject, content_type, correlation_id, properties, state, sender_key, body_id,
         header, body, deferred) = row[:19]  # fmt: skip
        # Positionally, in Message's field order (FIELD_ORDER, held by a test): its
        # dataclass __init__ takes 1.5 µs by keyword, 0.45 so, once per message.
        msg = Message(
            wid, stage, arrived, self.stage, message_id, sender, tuple(recipients or ()),
            user, peer, header_from, subject, content_type, correlation_id,
            dict(properties or {}), dict(state or {}), sender_key, header, body,
            None, row[-1],  # no loader yet; the claim token (xmin), last in both load queries
        )  # fmt: skip
        if body_id is not None and (self.needs is not Needs.BODY or deferred):
            keep = header is not None and self.needs is not Needs.METADATA
            msg._loader = body_loader(conn, body_id, keep_header=keep)
        return msg


def body_loader(conn: Conn, body_id: int, *, keep_header: bool) -> BodyLoader:
    """Load what the stage did not declare, on first access (one SELECT)."""

    def load() -> tuple[bytes | None, bytes | None]:
        row = conn.execute(
            query("workqueue_body_get"),
            {"body_id": body_id, "with_header": not keep_header},
            binary=True,
        ).fetchone()
        return (row[0], row[1]) if row else (None, None)

    return load
