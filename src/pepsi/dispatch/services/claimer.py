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

The arguments go as array literals that the statement casts (see
`pepsi.db.queries`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import psycopg

from pepsi.config.values import AMQP_STAGE_PREFIX
from pepsi.db.queries import number_array, query_text, text_array
from pepsi.dispatch.ledger import Claimed
from pepsi.dispatch.policy.fairness import FairShare

AConn = psycopg.AsyncConnection[tuple[Any, ...]]

MAX_SENDERS = 64  # pending senders a fair claim looks at per stage, from its window's start


class Claimer:
    def __init__(self, fair: FairShare | None, *, synchronous: bool = False) -> None:
        self.fair = fair
        self.synchronous = synchronous  # every claim waits for its WAL flush
        self.statements = 0  # claim statements run

    async def run_once(self, conn: AConn, capacities: Mapping[str, int]) -> list[Claimed]:
        """Claim up to `capacities[stage]` rows per stage; the rows in the order to serve
        them: highest priority first, then oldest (the fair claim returns them so)."""
        capacities = {stage: cap for stage, cap in capacities.items() if cap > 0}
        if not capacities:
            return []
        self.statements += 1
        commit = self.commit(capacities)
        if self.fair is None:
            cur = await conn.execute(
                query_text("workqueue_claim_fifo"),
                {
                    "stages": text_array(capacities),
                    "caps": number_array(capacities.values()),
                    "commit": commit,
                },
            )
            found = await cur.fetchall()
            if any(priority for _, _, priority in found):  # highest first, then oldest
                found.sort(key=lambda row: (-row[2], row[0]))
            else:
                found.sort()  # by id: the oldest first (a sort in SQL cost 5 % of a drain)
            return [Claimed(int(wid), str(stage)) for wid, stage, _ in found]
        return await self._fair(conn, self.fair, capacities, commit)

    def commit(self, capacities: Mapping[str, int]) -> str | None:
        """The claim's synchronous_commit: 'off', or None for the session's (see above)."""
        if self.synchronous or any(stage.startswith(AMQP_STAGE_PREFIX) for stage in capacities):
            return None
        return "off"

    async def _fair(
        self, conn: AConn, fair: FairShare, capacities: Mapping[str, int], commit: str | None
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
                },
            )
        ).fetchone()
        assert row is not None
        ids, stages, senders, starts = row
        for stage, start in zip(params["stages"], starts, strict=True):
            fair.window[str(stage)] = str(start)  # where the next claim's senders start
        return [
            Claimed(int(wid), str(stage), str(sender))
            for wid, stage, sender in zip(ids, stages, senders, strict=True)
        ]
