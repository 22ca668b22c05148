"""How a batch's decisions become statements (W-2, W-8; issue 32). Pure.

The runner decides each message (`outcomes`), collects the decisions in a
`Batch`, and writes them with the statements made here: one for every
ordinary outcome of the batch (`workqueue_record_outcomes`, or its `_edited`
form when a stage changed its messages), one per `Split`
(`workqueue_record_split`), one per transactional message
(`workqueue_record_outcome_tx`, with `outcome_word`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from psycopg.types.json import Jsonb

from pepsi.db.queries import number_array, query, query_text
from pepsi.stage import NewMessage
from pepsi.worker.outcomes import Decision


def outcome_word(decision: Decision) -> str:
    """The `pepsi.workqueue_record_outcome` outcome that writes `decision`."""
    if decision.stage is None:
        return "finish"
    if decision.status == "pending":
        return "advance"
    if decision.status == "paused":
        return "pause"
    return "fail"


@dataclass
class Batch:
    """The decisions of one batch; finished rows and updates as one statement takes them."""

    finished: list[int] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    decisions: dict[int, Decision] = field(default_factory=dict)
    # W-10: (stage, ns, outcome) of each stage a fused pass ran, by id; absent: one stage
    passes: dict[int, list[tuple[str, int, str]]] = field(default_factory=dict)

    edited: bool = False  # some update changes the message too (issue 32)
    splits: list[tuple[int, Decision]] = field(default_factory=list)
    content_ids: list[int] = field(default_factory=list)
    headers: list[bytes | None] = field(default_factory=list)
    bodies: list[bytes | None] = field(default_factory=list)

    def add(self, wid: int, decision: Decision) -> None:
        if decision.parts is not None:
            self.splits.append((wid, decision))  # a statement of its own (split_params)
        elif decision.stage is None:
            self.finished.append(wid)
        else:
            self.updates.append(decision.row(wid))
            if decision.edits is not None:
                self.edited = True
                if decision.edits.content:
                    self.content_ids.append(wid)
                    self.headers.append(decision.edits.header)
                    self.bodies.append(decision.edits.body)
        self.decisions[wid] = decision

    def statement(self, stage: str) -> tuple[Any, dict[str, Any]]:
        """The one statement that writes the batch, and its parameters."""
        params: dict[str, Any] = {
            "stage": stage,
            "finished": number_array(self.finished),  # a literal: see pepsi.db.queries
            "updates": Jsonb(self.updates),
        }
        if not self.edited:
            return query_text("workqueue_record_outcomes"), params
        params.update(content_ids=self.content_ids, headers=self.headers, bodies=self.bodies)
        return query("workqueue_record_outcomes_edited"), params


def split_params(
    wid: int, stage: str, decision: Decision, token: str | None = None
) -> dict[str, Any]:
    """`workqueue_record_split`'s parameters for a split decision (issue 32); `stage`
    is the one the row was claimed at."""
    assert decision.parts is not None
    found = decision.edits
    parts = [{"recipients": list(group), **part.row(wid)} for group, part in decision.parts]
    return {
        "id": wid,
        "stage": stage,
        "parts": Jsonb(parts),
        "spawn": Jsonb([_made(m) for m in decision.spawn]),
        "spawn_headers": [m.header for m in decision.spawn],
        "spawn_bodies": [m.body for m in decision.spawn],
        "edits": None if found is None else Jsonb(found.columns),
        "header": None if found is None else found.header,
        "body": None if found is None else found.body,
        "token": token,
    }


def _made(message: NewMessage) -> dict[str, Any]:
    """A new message's metadata as `workqueue_record_split` reads it."""
    return {
        "stage": message.stage,
        "sender": message.sender,
        "recipients": list(message.recipients),
        "message_id": message.message_id,
        "header_from": message.header_from,
        "subject": message.subject,
        "content_type": message.content_type,
        "properties": message.properties,
        "state": message.state,
    }
