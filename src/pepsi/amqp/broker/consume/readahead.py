"""The read-ahead: claimed ids loaded into their stage's `ready` buffer, ahead of credit.

The dispatcher's one claim (P-1, P-4) reads ahead for AMQP stages: up to their
consumers' prefetch windows (`consumers.Registry.targets`), claimed when less than
half of that is left (`capacities`), so each claim and each load is a batch. The
fetch task loads what was claimed (one statement for everything claimed meanwhile)
into the stage's `ready` buffer, a step at a time, and hands each step to `pump`.
Rows returned to pending meanwhile move the stage's epoch: what was claimed before
they were written is not sent before them. What is read ahead counts as ready
messages (`ready_count`, queue.purge, basic.get's `take_ready`), and goes back to
pending when no consumer is left (`_unready`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import psycopg

from pepsi.amqp.broker.consume.fetched import Fetched, fetched_row
from pepsi.amqp.broker.consume.state import DelivererState, id_array, quorum_queue, subtract
from pepsi.db.queries import query
from pepsi.errors import PepsiError, one_line

log = logging.getLogger("pepsi.amqp")

READ_AHEAD_BYTES = 32 * 1024 * 1024  # bodies read ahead per stage before claims pause
LOAD_STEP = 64  # loaded rows put in the read-ahead between turns of the event loop


class ReadAhead(DelivererState):
    """Claims in, loaded rows into `ready` (a part of `delivery.Deliverer`)."""

    # ---- what the dispatcher asks -------------------------------------------------------

    def capacities(self) -> dict[str, int]:
        """Ids each consumed stage should claim now (P-6, for the one claim): what its
        read-ahead lacks, once it is down to half (so claims come in batches)."""
        if self._closing:
            return {}
        caps: dict[str, int] = {}
        for stage, target in self.registry.targets(self.single_active).items():
            if self._returning.get(stage):
                continue  # after they are written: they come first again
            have = self._have(stage)
            if have * 2 <= target and self._ready_bytes.get(stage, 0) < READ_AHEAD_BYTES:
                caps[stage] = target - have
        return caps

    def deliver(self, rows: Iterable[tuple[int, str, Sequence[Any] | None]]) -> None:
        """Claimed (id, stage, row) rows into their stage's read-ahead, then sent. A small
        claim brings each row as `amqp_delivery_load` reads it: when every one came and
        no load is under way (that would hold older rows), they go in at once, a
        statement fewer; else the fetch task loads them, in claim order."""
        claimed: list[tuple[int, str, int]] = []
        loaded: dict[int, Sequence[Any]] = {}
        for wid, stage, row in rows:
            claimed.append((wid, stage, self._epoch.get(stage, 0)))
            if row is not None:
                loaded[wid] = row
        if self._take_in(claimed, loaded):
            self.loaded_with_claim += len(claimed)

    def _take_in(
        self, claimed: list[tuple[int, str, int]], loaded: Mapping[int, Sequence[Any]]
    ) -> bool:
        """Rows taken for consumers ((id, stage, epoch), and those that came loaded) into
        the read-ahead: at once when every one came loaded and no load is under way
        (that would hold older rows); else the fetch task loads them, in order. Whether
        at once."""
        for _, stage, _ in claimed:
            self._loading[stage] = self._loading.get(stage, 0) + 1
        if not claimed:
            return False
        if len(loaded) == len(claimed) and not self._loads_pending():
            for stage in self._load(claimed, loaded):
                self.pump(stage)
            return True
        self._claimed += claimed
        self._start()
        self._fetch_wake.set()
        return False

    def _have(self, stage: str) -> int:
        """The stage's rows read ahead, loading, or being written for it (direct)."""
        return (
            len(self.ready.get(stage, ()))
            + self._loading.get(stage, 0)
            + self._reserved.get(stage, 0)
        )

    # ---- direct delivery (publish/direct.py) ---------------------------------------------

    def direct_room(self, stages: Iterable[str]) -> dict[str, int]:
        """Rows of a publish that each of `stages` takes without a claim, written
        running: what its read-ahead lacks of its consumers' target, where the
        dispatcher knows that nothing is pending (an older row goes first) and nothing
        goes back."""
        if self._closing:
            return {}
        room: dict[str, int] = {}
        registry = self.registry
        for stage in stages:
            if self._returning.get(stage) or self._ready_bytes.get(stage, 0) >= READ_AHEAD_BYTES:
                continue
            free = registry.target(stage, self.single_active(stage)) - self._have(stage)
            if free > 0 and self.link.known_pending(stage) == 0:
                room[stage] = free
        return room

    def reserve_direct(self, taken: Mapping[str, int]) -> dict[str, int]:
        """Hold room for rows about to be written running; the stages' epochs now (a row
        that goes back meanwhile is older: the direct rows then follow it)."""
        for stage, n in taken.items():
            self._reserved[stage] = self._reserved.get(stage, 0) + n
        return {stage: self._epoch.get(stage, 0) for stage in taken}

    def release_direct(self, taken: Mapping[str, int]) -> None:
        """The reservation ends: committed (then `deliver_direct`) or not."""
        for stage, n in taken.items():
            subtract(self._reserved, stage, n)

    def deliver_direct(
        self, rows: Sequence[tuple[int, str, Sequence[Any]]], epochs: Mapping[str, int]
    ) -> None:
        """Rows committed running for the consumers, as a claim's loaded rows, with the
        epochs of their reservation (a row given back meanwhile goes first)."""
        if not rows:
            return
        self.direct_rows += len(rows)
        self.link.direct(len(rows))
        claimed = [(wid, stage, epochs.get(stage, 0)) for wid, stage, _ in rows]
        self._take_in(claimed, {wid: row for wid, _, row in rows})

    def _loads_pending(self) -> bool:
        """Whether claimed rows wait for the fetch task or are in its load."""
        return bool(self._claimed or self._in_fetch or self._in_fetch_rest)

    # ---- the read-ahead as ready messages ------------------------------------------------

    def ready_count(self, stage: str) -> int:
        """The stage's messages that are ready to AMQP though claimed: read ahead, or
        claimed for its consumers and still being loaded (`running` in SQL, and no client
        has them: `message_count` counts them, so that a count of 0 means sent)."""
        return len(self.ready.get(stage, ())) + self._loading.get(stage, 0)

    def take_ready(self, stage: str) -> Fetched | None:
        """basic.get on a consumed queue: the head of its read-ahead, if any."""
        ready = self.ready.get(stage)
        if not ready:
            return None
        now = self.clock()
        while ready:
            fetched = ready.popleft()
            self._ready_bytes[stage] = self._ready_bytes.get(stage, 0) - len(fetched.body)
            if not fetched.expired(now):
                return fetched
            self._outcomes.dead.append((stage, fetched.wid, "expired"))
            self._settle_soon()
        return None

    def drop_ready(self, stage: str) -> list[int]:
        """queue.purge or queue.delete: the read-ahead is ready messages too; its ids."""
        ready = self.ready.pop(stage, None) or deque()
        self._ready_bytes.pop(stage, None)
        return [f.wid for f in ready]

    def purge_loading(self, stage: str) -> int:
        """queue.purge: rows claimed for the stage's consumers whose load has not come
        back are ready messages too (`ready_count`): deleted when it does. How many."""
        count = self._loading.get(stage, 0)
        if count:
            epoch = self._epoch.get(stage, 0) + 1
            self._epoch[stage] = self._purged[stage] = epoch
        return count

    def _unready(self, stage: str) -> None:
        """No consumer left: the read-ahead goes back to pending as it was."""
        ids = self.drop_ready(stage)
        if ids:
            self.unsent(stage, ids)

    # ---- loading ------------------------------------------------------------------------

    async def _fetch_loop(self) -> None:
        delays = self.backoff.delays()
        while True:
            if not self._claimed:
                if self._closing:
                    return
                self._fetch_wake.clear()
                await self._fetch_wake.wait()
                continue
            claimed, self._claimed = self._claimed, []
            ids = [wid for wid, _, _ in claimed]
            self._in_fetch = ids
            try:
                conn = await self._connection("fetch")
                # Binary results: a body comes as its bytes, not as hex twice their size
                # (half the data to read, and the server's 8 KB writes wake this loop
                # half as often; no hex encoding and decoding on either side).
                cur = await conn.execute(
                    query("amqp_delivery_load"), {"ids": id_array(ids)}, binary=True
                )
                rows = {int(row[0]): row for row in await cur.fetchall()}
            except (psycopg.Error, PepsiError, OSError) as error:
                log.error("amqp: could not load %d deliveries: %s", len(ids), one_line(error))
                await self._drop("fetch")
                self._in_fetch = []
                for wid, stage, _ in claimed:  # back to pending when the database is back
                    self._loading[stage] -= 1
                    self.unsent(stage, [wid])
                await asyncio.sleep(next(delays))
                continue
            delays = self.backoff.delays()
            await self._load_in_steps(claimed, rows)

    async def _load_in_steps(
        self, claimed: list[tuple[int, str, int]], rows: Mapping[int, Sequence[Any]]
    ) -> None:
        """`_load` and send, LOAD_STEP rows at a time, letting the loop run in between: a
        claim's 500 rows took the loop for about 2 ms, during which consumers' acks
        waited, and with them the deliveries their credit frees (at prefetch 100, a
        consumer that has handled what it holds then idles). Rows not loaded yet stay
        held (`_in_fetch_rest`)."""
        for start in range(0, len(claimed), LOAD_STEP):
            # held, as ids only when `held` asks (a list of ids per step cost a copy)
            self._in_fetch, self._in_fetch_rest = [], claimed[start + LOAD_STEP :]
            for stage in self._load(claimed[start : start + LOAD_STEP], rows):
                self.pump(stage)
            if self._in_fetch_rest:
                await asyncio.sleep(0)

    def _load(
        self, claimed: list[tuple[int, str, int]], rows: Mapping[int, Sequence[Any]]
    ) -> set[str]:
        """Loaded rows into their stages' read-ahead, in claim order; the stages. What
        the rows of one stage share (its queue, read-ahead) is looked up once."""
        stages: dict[str, tuple[str, bool, deque[Fetched]]] = {}
        loaded: dict[str, int] = {}  # stage -> rows taken off `_loading`
        added: dict[str, int] = {}  # stage -> body bytes added to the read-ahead
        gone: dict[str, list[int]] = {}
        now = self.clock()
        for wid, stage, epoch in claimed:
            loaded[stage] = loaded.get(stage, 0) + 1
            row = rows.get(wid)
            if row is None:  # purged or deleted with its queue meanwhile
                gone.setdefault(stage, []).append(wid)
                continue
            known = stages.get(stage)
            if known is None:
                known = stages[stage] = self._load_target(stage)
            name, quorum, ready = known
            # read per row: a row sent back below moves the epoch, and the rows after it
            # (claimed later, before that return is written) must not pass it
            if epoch != self._epoch.get(stage, 0):
                if epoch < self._purged.get(stage, 0):  # purged while it was loading
                    self._outcomes.acked.append((stage, wid))
                    self._settle_soon()
                else:  # older messages went back meanwhile: after them
                    self.unsent(stage, [wid])
                continue
            fetched = fetched_row(row, name, quorum)
            if fetched.expires is not None and fetched.expires <= now:
                self._outcomes.dead.append((stage, wid, "expired"))  # RabbitMQ never
                self._settle_soon()  # delivers an expired message
                continue
            ready.append(fetched)
            added[stage] = added.get(stage, 0) + len(fetched.body)
        for stage, count in loaded.items():
            subtract(self._loading, stage, count)
        for stage, size in added.items():
            self._ready_bytes[stage] = self._ready_bytes.get(stage, 0) + size
        for stage, ids in gone.items():
            self.link.consumed(stage, ids)
        return set(added)

    def _load_target(self, stage: str) -> tuple[str, bool, deque[Fetched]]:
        """What a load needs of a stage: its queue's name, whether the queue counts
        deliveries (quorum), its read-ahead."""
        queue = self.queues.get(stage)
        ready = self.ready.get(stage)
        if ready is None:
            ready = self.ready[stage] = deque()
        return queue.name if queue else stage, quorum_queue(queue), ready


__all__ = ["LOAD_STEP", "READ_AHEAD_BYTES", "ReadAhead"]
