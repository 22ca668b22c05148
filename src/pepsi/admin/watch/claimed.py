"""Which `running` rows a worker has started, and which it has only read ahead (issue 33).

The table cannot tell them apart: the claim sets a row `running` when the dispatcher
takes it for a worker's queue (up to QUEUE_LIMIT ahead), and the worker starts it only
once the ones before it are done. The dispatcher knows the head of each worker's queue
and names those messages in its live snapshot (`executing`, pepsi.dispatch.services.live); this
reads the next snapshot, and `pepsi queue` shows the others as `claimed`. An AMQP
queue's rows are its consumers' (delivered or read ahead for them) and stay `running`.
Writing a status per start would cost a statement per message; the snapshot costs none.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import psycopg

from pepsi.admin.watch.live_listener import LiveListener
from pepsi.config.values import is_amqp_stage
from pepsi.db.queries import query

CLAIMED = "claimed"  # running in the table, waiting in a worker's queue
WAIT = 1.5  # seconds: a busy dispatcher sends a snapshot every LIVE_INTERVAL (1 s)


def started(conn: psycopg.Connection[Any], *, timeout: float = WAIT) -> frozenset[int] | None:
    """The ids workers have started, from the dispatcher's next live snapshot; None when
    none comes within `timeout` (no dispatcher, or an idle one) or it names only some.
    `conn` must be in autocommit mode (notifications come between transactions)."""
    listener = LiveListener(conn)
    listener.start()
    for snapshot in listener.snapshots(timeout):
        if snapshot.final or not snapshot.executing_complete:
            return None
        return frozenset(snapshot.executing)
    return None


def label(status: str, wid: int, stage: str, running: frozenset[int] | None) -> str:
    """The status to show: `claimed` for a worker's row it has not started."""
    if status != "running" or running is None or is_amqp_stage(stage) or wid in running:
        return status
    return CLAIMED


def split_counts(
    counts: Mapping[str, Mapping[str, int]], started_by_stage: Mapping[str, int]
) -> dict[str, dict[str, int]]:
    """Per stage, `running` split into `running` (started) and `claimed` (read ahead)."""
    out: dict[str, dict[str, int]] = {}
    for stage, by_status in counts.items():
        row = dict(by_status)
        running = row.get("running", 0)
        if running and not is_amqp_stage(stage):
            begun = min(started_by_stage.get(stage, 0), running)
            row["running"] = begun
            if running - begun:
                row[CLAIMED] = running - begun
            if not begun:
                del row["running"]
        out[stage] = row
    return out


def has_worker_rows(counts: Mapping[str, Mapping[str, int]]) -> bool:
    """Whether any stage but an AMQP queue has running rows (else there is nothing to ask)."""
    return any(c.get("running") for s, c in counts.items() if not is_amqp_stage(s))


def started_by_stage(conn: psycopg.Connection[Any], ids: Iterable[int]) -> dict[str, int]:
    """How many of `ids` are running, per stage (one probe of the primary key each)."""
    rows = conn.execute(query("workqueue_started_by_stage"), {"ids": list(ids)}).fetchall()
    return {str(stage): int(n) for stage, n in rows}
