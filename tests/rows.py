"""Rows as a claim leaves them, for tests that run a worker's StageRunner in-process."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

NOW = datetime(2026, 1, 1, tzinfo=UTC)

# The claim statements' parameters that ask for no rows back, for workers
# (rows_for) or AMQP consumers (amqp_for).
NO_ROWS: dict[str, Any] = {"rows_for": [], "rows_max": 0, "amqp_for": [], "amqp_bytes": 0}


def running(
    conn: psycopg.Connection[Any],
    stage_name: str = "a",
    *,
    sender: str | None = None,
    recipients: list[str] | None = None,
    properties: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
    body: bytes | None = None,
    header: str = "Subject: hi",
    arrived: datetime = NOW,
) -> int:
    """A row as a claim leaves it: `running` at `stage_name`; its id."""
    body_id = None
    if body is not None:
        found = conn.execute(
            "INSERT INTO pepsi.workqueue_body (header, body) VALUES (%s, %s) RETURNING body_id",
            (header, body),
        ).fetchone()
        assert found is not None
        body_id = found[0]
    found = conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status, arrived, sender, recipients, properties,"
        " state, body_id) VALUES (%s, 'running', %s, %s, %s, %s, %s, %s) RETURNING workqueue_id",
        (stage_name, arrived, sender, recipients or [], Jsonb(properties or {}),
         Jsonb(state or {}), body_id),
    ).fetchone()  # fmt: skip
    assert found is not None
    return int(found[0])
