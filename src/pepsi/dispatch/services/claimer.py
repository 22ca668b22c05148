"""The claimer: one claim statement for every stage with room (P-4, P-5).

Given each stage's free capacity, it runs ONE statement that marks up to that
many pending rows running and returns them, oldest first (FIFO) or fairly
between senders (`pepsi.workqueue_claim_fair`, with the lags of the fair-share
ledger). It is the only writer of pending → running.

A claim commits without waiting for its WAL flush (the flush was most of
an idle claim: 1.1-1.3 ms of it on a busy 2-core machine, 0.35-0.5 ms
without): a claim lost with a crash of the database leaves its rows pending,
so they are claimed and run again, which at-least-once allows (a worker's
outcome, later in the WAL, is lost with it). Claims wait for the flush when
the workers' outcomes do (WORKER_SYNCHRONOUS_COMMIT = yes: no re-run from a
failover) and when an AMQP queue takes part: a delivery must not come back
unmarked as redelivered.

A claim also says which stages it left without a pending row (`drained`, a
probe after the claim in its statement): the dispatcher then skips them until
news comes, rather than claim again after each answer or freed credit and find
nothing (`policy.known_pending`), and an AMQP queue's `queue.declare` counts its
pending rows without a query (Celery's client declares its reply queue before
every task, and a claim has just taken the result that came).

A claim of at most ROWS_MAX rows also returns the rows themselves for the
stages whose workers take them (`rows_for`: metadata-only stages of Pepsi's
own worker, docs/protocol.md): those workers run them without a load of
their own, one statement fewer on an idle message's way. Likewise for AMQP
queues: what basic.deliver sends of each row (`Claimed.delivery`, header and
body up to DELIVERY_BYTES), so that the read-ahead skips its load. A larger
claim (a backlog draining) returns ids only: the rows would be built in the one
claim statement instead of in the loads, side by side. The claim's answer is
read in binary (the AMQP rows are records, and their bodies bytes).

The arguments go as array literals that the statement casts (see
`pepsi.db.queries`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

import psycopg

from pepsi.config.values import AMQP_STAGE_PREFIX
from pepsi.db.queries import number_array, query_text, text_array
from pepsi.dispatch.ledger import Claimed
from pepsi.dispatch.policy.fairness import FairShare

AConn = psycopg.AsyncConnection[tuple[Any, ...]]

MAX_SENDERS = 64  # pending senders a fair claim looks at per stage, from its window's start
ROWS_MAX = 32  # a claim of at most this many rows hands them to the workers that take rows
ROW_LIMIT = 60_000  # bytes: a longer row goes as its id (the worker loads it)
DELIVERY_BYTES = 65_536  # header and body of an AMQP row a claim returns; larger: loaded


class Claimer:
    def __init__(self, fair: FairShare | None, *, synchronous: bool = False) -> None:
        self.fair = fair
        self.synchronous = synchronous  # every claim waits for its WAL flush
        self.statements = 0  # claim statements run
        self.drained: frozenset[str] = frozenset()  # the last claim's, see above

    async def run_once(
        self,
        conn: AConn,
        capacities: Mapping[str, int],
        rows_for: Collection[str] = (),
    ) -> list[Claimed]:
        """Claim up to `capacities[stage]` rows per stage; the rows in the order to serve
        them: highest priority first, then oldest (the fair claim returns them so). A
        small claim carries the rows of `rows_for`'s stages too."""
        capacities = {stage: cap for stage, cap in capacities.items() if cap > 0}
        self.drained = frozenset()
        if not capacities:
            return []
        self.statements += 1
        commit = self.commit(capacities)
        rows_for = [stage for stage in rows_for if stage in capacities]
        amqp_for = [s for s in capacities if s.startswith(AMQP_STAGE_PREFIX)]
        rows = {
            "rows_for": text_array(rows_for),
            "rows_max": ROWS_MAX,
            "amqp_for": text_array(amqp_for),
            "amqp_bytes": DELIVERY_BYTES,
        }
        if self.fair is None:
            cur = await conn.execute(
                query_text("workqueue_claim_fifo"),
                {
                    "stages": text_array(capacities),
                    "caps": number_array(capacities.values()),
                    "commit": commit,
                    **rows,
                },
                binary=True,
            )
            found = await cur.fetchall()
            if found:
                self.drained = frozenset(found[0][4] or ())
            if any(row[2] for row in found):  # highest first, then oldest
                found.sort(key=lambda row: (-row[2], row[0]))
            else:
                found.sort()  # by id (unique): the oldest first (a sort in SQL cost 5 % of a drain)
            return [
                Claimed(int(wid), str(stage), None, _text(row), delivery)
                for wid, stage, _, row, _, delivery in found
            ]
        return await self._fair(conn, self.fair, capacities, commit, rows)

    def commit(self, capacities: Mapping[str, int]) -> str | None:
        """The claim's synchronous_commit: 'off', or None for the session's (see above)."""
        if self.synchronous or any(stage.startswith(AMQP_STAGE_PREFIX) for stage in capacities):
            return None
        return "off"

    async def _fair(
        self,
        conn: AConn,
        fair: FairShare,
        capacities: Mapping[str, int],
        commit: str | None,
        rows: Mapping[str, object],
    ) -> list[Claimed]:
        params = fair.claim_params(capacities)
        row = await (
            await conn.execute(
                query_text("workqueue_claim_fair"),
                {
                    "stages": text_array(params["stages"]),
                    "caps": number_array(params["caps"]),
                    "fifo": number_array(params["fifo"]),
                    "averages": number_array(params["averages"]),
                    "starts": text_array(params["starts"]),
                    "lags": json.dumps(params["lags"]),
                    "max_senders": MAX_SENDERS,
                    "commit": commit,
                    **rows,
                },
                binary=True,
            )
        ).fetchone()
        assert row is not None
        ids, stages, senders, starts, payloads, drained, deliveries = row
        self.drained = frozenset(drained or ())
        for stage, start in zip(params["stages"], starts, strict=True):
            fair.window[str(stage)] = str(start)  # where the next claim's senders start
        return [
            Claimed(
                int(wid), str(stage), str(sender), _row(payloads, i),
                None if deliveries is None else deliveries[i],
            )
            for i, (wid, stage, sender) in enumerate(zip(ids, stages, senders, strict=True))
        ]  # fmt: skip


def _row(payloads: list[str | None] | None, i: int) -> bytes | None:
    """The i-th claimed row as a worker takes it, if the claim returned it."""
    return None if payloads is None else _text(payloads[i])


def _text(row: str | None) -> bytes | None:
    """A claimed row as a worker takes it, if there is one short enough for a line."""
    return None if row is None or len(row) > ROW_LIMIT else row.encode()
