"""Deliveries: claimed ids to basic.deliver frames, and consumers' outcomes to rows.

The dispatcher's one claim (P-1, P-4) reads ahead for AMQP stages: up to their
consumers' prefetch windows (`consumers.Registry.targets`), claimed when less
than half of that is left, so each claim and each load is a batch. One task
loads what was claimed (one statement for everything claimed meanwhile) into
the stage's `ready` buffer; messages leave it for consumers as their credit
allows (`pump`), at once when an ack frees credit, without a round trip. Another
task writes what consumers decided, many outcomes per commit (`amqp_settle`): an
ack deletes the row, a return puts it back to pending at its place with the
redelivered mark, a reject without requeue dead-letters it (`amqp_dead_letter`).
Credit is freed when the client's ack arrives, before its row is written, as in
RabbitMQ: if the write is lost (database down, crash) the message is delivered
again: at least once (SPEC R-6).

Each task has a connection of its own, reconnecting with the usual backoff; until
their rows are written, ids stay in `held()`, so the dispatcher's reset of
orphaned rows after a reconnect leaves them alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import psycopg
from pamqp import commands

from pepsi.amqp.broker.catalogue import Queue
from pepsi.amqp.model.arguments import QUORUM
from pepsi.amqp.model.consumers import ChannelBook, Consumer, Delivery, Registry
from pepsi.amqp.wire import dead_letters, headers
from pepsi.amqp.wire.properties import decode_properties, encode_properties
from pepsi.db.backoff import Backoff
from pepsi.db.connect import connect_async
from pepsi.db.queries import query
from pepsi.errors import PepsiError, one_line

log = logging.getLogger("pepsi.amqp")

APPLICATION_NAME = "pepsi-amqp-delivery"
EMPTY_PROPERTIES = b"\x00\x00"  # a row without a stored content header: no properties
MAX_SETTLE_BATCH = 5000  # outcomes per commit
# Acks alone wait up to this long for more before they are written (nothing waits on
# them: the client's credit is freed at once), so that a statement writes hundreds: each
# cost the dispatcher and PostgreSQL more than its rows did. 10 ms took two thirds of the
# statements off the consuming path; 50 ms consumed about 12 % faster again.
SETTLE_GATHER_SECONDS = 0.05
SETTLE_GATHER_ROWS = 1000  # ... and no longer once this many are waiting
READ_AHEAD_BYTES = 32 * 1024 * 1024  # bodies read ahead per stage before claims pause
LOAD_STEP = 64  # loaded rows put in the read-ahead between turns of the event loop

AConn = psycopg.AsyncConnection[tuple[Any, ...]]


class DispatchLink(Protocol):
    """What the dispatcher learns from the deliverer (see Dispatcher._serve_amqp)."""

    def wake(self, cause: str) -> None: ...

    def returned(self, stage: str, ids: list[int]) -> None:
        """Back to pending: the fair-share debit is refunded."""

    def consumed(self, stage: str, ids: list[int]) -> None:
        """Settled for good (acked, dead-lettered, or gone with its queue)."""


class NoDispatch:
    """A listener without a dispatcher (tests): nothing claims, nothing to tell."""

    def wake(self, cause: str) -> None:
        pass

    def returned(self, stage: str, ids: list[int]) -> None:
        pass

    def consumed(self, stage: str, ids: list[int]) -> None:
        pass


class Sender(Protocol):
    """The channel side of a delivery (BrokerChannel)."""

    open: bool

    def delivery_frames(self, consumer: Consumer, tag: int, fetched: Fetched) -> bytes: ...

    def send_frames(self, data: bytes) -> None: ...


class Fetched(NamedTuple):
    """A row as basic.deliver and basic.get-ok need it."""

    wid: int
    exchange: str
    routing_key: str
    redelivered: bool
    delivery_count: int
    expires: float | None  # POSIX seconds; RabbitMQ never delivers an expired message
    raw_properties: bytes
    body: bytes

    def expired(self, now: float) -> bool:
        return self.expires is not None and self.expires <= now


def fetched_row(row: Sequence[Any], queue_name: str, quorum: bool = True) -> Fetched:
    """A row of `amqp_delivery_load` (or `amqp_get`): id, exchange, routing key, delivery
    count, redelivered, x-death, first death, expires, header, body. `quorum`: the queue
    counts deliveries in `x-delivery-count` (classic ones do not)."""
    wid, exchange, routing_key, count, redelivered, deaths, first, expires, header, body = row[:10]
    foreign = row[10]
    if foreign is None and not count and not deaths:  # the common case: a first delivery
        return Fetched(
            int(wid), exchange or "", queue_name if routing_key is None else routing_key,
            bool(redelivered), 0, None if expires is None else float(expires),
            EMPTY_PROPERTIES if header is None else bytes(header),
            b"" if body is None else bytes(body),
        )  # fmt: skip
    count = int(count or 0)
    if foreign is not None:  # advanced here by a stage of the pipeline: no AMQP header
        message_id, content_type, correlation_id, properties = foreign
        raw = pipeline_properties(message_id, content_type, correlation_id, properties, header)
    else:
        raw = bytes(header) if header is not None else EMPTY_PROPERTIES
    if (count and quorum) or deaths:
        entries: dict[str, object] = {}
        if count and quorum:
            entries["x-delivery-count"] = count
        if deaths:
            entries.update(dead_letters.death_headers(deaths, first))
            raw = headers.without_expiration(raw)  # RabbitMQ: in x-death's original-expiration
        raw = headers.set_headers(raw, entries)
    return Fetched(
        int(wid),
        exchange or "",
        queue_name if routing_key is None else routing_key,
        bool(redelivered) or count > 0,
        count,
        None if expires is None else float(expires),
        raw,
        bytes(body) if body is not None else b"",
    )


def pipeline_properties(
    message_id: str | None,
    content_type: str | None,
    correlation_id: str | None,
    properties: Mapping[str, Any] | None,
    header: bytes | None,
) -> bytes:
    """AMQP properties for a message a stage of the pipeline sent to an AMQP queue (NEXT
    = amqp:QUEUE): its columns as the properties of the same name, its `properties` as
    headers, its header block (if any) as the header `x-pepsi-header`; persistent."""
    table: dict[str, object] = {
        str(k): v for k, v in (properties or {}).items() if _header_value(v)
    }
    if header is not None:
        table["x-pepsi-header"] = bytes(header)
    raw = encode_properties(
        commands.Basic.Properties(
            content_type=_short(content_type),
            message_id=_short(message_id),
            correlation_id=_short(correlation_id),
            delivery_mode=2,
        )
    )
    return headers.set_headers(raw, table) if table else raw


def _short(text: str | None) -> str | None:
    """A property that fits a shortstr, or none."""
    return text if text is not None and len(text.encode()) <= 255 else None


def _header_value(value: object) -> bool:
    """JSON values a field table carries as they are (nested ones too)."""
    if value is None or isinstance(value, bool | int | float | str):
        return not isinstance(value, int) or -(2**63) <= value < 2**63
    if isinstance(value, list):
        return all(_header_value(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _header_value(v) for k, v in value.items())
    return False


def id_array(ids: Iterable[int]) -> str:
    """A bigint[] literal: psycopg dumps a list element by element in Python, thousands
    of times a second here; one string is cheaper and means the same to `::bigint[]`."""
    return "{" + ",".join(map(str, ids)) + "}"


# A dead letter starts afresh in its new queue: no delivery count, no failure of the old.
_NOT_CARRIED = frozenset({
    "redelivered", "delivery_count", "last_error", "failed_stage", "failure_class",
    "dead_letter_reason",
})  # fmt: skip


def _quorum(queue: Queue | None) -> bool:
    """Delivery counting and limits are quorum queues' (x-queue-type = quorum)."""
    return queue is not None and queue.arguments.queue_type == QUORUM


@dataclass
class Outcomes:
    """Outcomes waiting for their commit, by kind; ids with their stage."""

    acked: list[tuple[str, int]] = field(default_factory=list)
    returned: list[tuple[str, int]] = field(default_factory=list)
    unsent: list[tuple[str, int]] = field(default_factory=list)
    dead: list[tuple[str, int, str]] = field(default_factory=list)  # (stage, id, reason)

    def __len__(self) -> int:
        return len(self.acked) + len(self.returned) + len(self.unsent) + len(self.dead)

    def ids(self) -> list[int]:
        return [
            *(w for _, w in self.acked),
            *(w for _, w in self.returned),
            *(w for _, w in self.unsent),
            *(w for _, w, _ in self.dead),
        ]

    def take(self, limit: int) -> Outcomes:
        taken = Outcomes()
        room = limit
        for name in ("acked", "returned", "unsent", "dead"):
            mine: list[Any] = getattr(self, name)
            part, rest = mine[:room], mine[room:]
            setattr(taken, name, part)
            setattr(self, name, rest)
            room -= len(part)
        return taken

    def put_back(self, other: Outcomes) -> None:
        self.acked[:0] = other.acked
        self.returned[:0] = other.returned
        self.unsent[:0] = other.unsent
        self.dead[:0] = other.dead


class DeadLetterRoute(Protocol):
    """Where the catalogue sends a dead letter: the destination stages (sorted), and the
    x-message-ttl (ms) of those whose queue has one."""

    async def __call__(
        self, stage: str, exchange: str, routing_keys: list[str], headers: dict[str, Any] | None
    ) -> tuple[list[str], dict[str, int]]: ...


def worth_gathering(outcomes: Outcomes, *, awaited: bool, closing: bool) -> bool:
    """Whether the outcomes waiting should wait SETTLE_GATHER_SECONDS for more before they
    are written: only acks (a returned or dead-lettered message goes at once), fewer than
    SETTLE_GATHER_ROWS, no `flush()` waiting on them, the deliverer not stopping."""
    return (
        not awaited
        and not closing
        and not (outcomes.returned or outcomes.unsent or outcomes.dead)
        and len(outcomes.acked) < SETTLE_GATHER_ROWS
    )


class Deliverer:
    """The claim's ids to consumers, and their outcomes to the rows (see the module doc)."""

    def __init__(
        self,
        dsn: str,
        connect_timeout: float,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.registry = Registry()
        self.link: DispatchLink = NoDispatch()
        self.queues: dict[str, Queue] = {}  # stage -> its queue, for those consumed or got
        self.books: set[ChannelBook] = set()  # every open channel's book
        self.dead_letter_route: DeadLetterRoute | None = None
        self.delivered = 0  # messages sent (tests, the benchmark)
        self.ready: dict[str, deque[Fetched]] = {}  # stage -> read ahead, not yet sent
        self._ready_bytes: dict[str, int] = {}
        self._claimed: list[tuple[int, str, int]] = []  # (id, stage, epoch) to be loaded
        # Messages going back to pending are written before the stage claims again, and
        # what was claimed before they went back is not sent before them: per stage, the
        # returns not written yet, and a count of returns (a claim's epoch).
        self._returning: dict[str, int] = {}
        self._epoch: dict[str, int] = {}
        # Per stage: rows claimed before this epoch were purged while their load ran.
        self._purged: dict[str, int] = {}
        self._loading: dict[str, int] = {}  # per stage: claimed, not in `ready` yet
        self._outcomes = Outcomes()
        self._barriers: list[asyncio.Future[None]] = []  # flush() callers
        self._fetch_wake = asyncio.Event()
        self._settle_wake = asyncio.Event()
        self._gathering = False  # the settle task waits for more acks ...
        self._gather_cut = asyncio.Event()  # ... until this is set or the time is up
        self._fetch_conn: AConn | None = None
        self._settle_conn: AConn | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._in_fetch: list[int] = []  # ids of the load running now
        # ... or, while a load goes out in steps, the claimed rows not loaded yet
        self._in_fetch_rest: list[tuple[int, str, int]] = []
        self._to_pump: set[str] = set()  # stages whose consumers got credit back
        self._pump_scheduled = False
        self._in_settle: list[int] = []  # ids of the commit running now

    # ---- what the dispatcher asks -------------------------------------------------------

    def single_active(self, stage: str) -> bool:
        queue = self.queues.get(stage)
        return queue is not None and queue.arguments.single_active_consumer

    def capacities(self) -> dict[str, int]:
        """Ids each consumed stage should claim now (P-6, for the one claim): what its
        read-ahead lacks, once it is down to half (so claims come in batches)."""
        if self._closing:
            return {}
        caps: dict[str, int] = {}
        for stage, target in self.registry.targets(self.single_active).items():
            if self._returning.get(stage):
                continue  # after they are written: they come first again
            have = len(self.ready.get(stage, ())) + self._loading.get(stage, 0)
            if have * 2 <= target and self._ready_bytes.get(stage, 0) < READ_AHEAD_BYTES:
                caps[stage] = target - have
        return caps

    def deliver(self, rows: Iterable[tuple[int, str]]) -> None:
        """Claimed (id, stage) rows: loaded into their stage's read-ahead, then sent."""
        claimed = [(wid, stage, self._epoch.get(stage, 0)) for wid, stage in rows]
        for _, stage, _ in claimed:
            self._loading[stage] = self._loading.get(stage, 0) + 1
        self._claimed += claimed
        if self._claimed:
            self._start()
            self._fetch_wake.set()

    def held(self) -> list[int]:
        """Ids this side holds as running: read ahead, delivered, or being written."""
        ids = [d.wid for book in self.books for d in book.unacked.values()]
        ids += [f.wid for ready in self.ready.values() for f in ready]
        ids += [wid for wid, _, _ in self._claimed]
        ids += self._outcomes.ids()
        ids += self._in_fetch
        ids += [wid for wid, _, _ in self._in_fetch_rest]
        ids += self._in_settle
        return ids

    # ---- sending ------------------------------------------------------------------------

    def pump(self, stage: str) -> None:
        """Send the stage's read-ahead to its consumers, round robin, as far as their
        credit goes; what no consumer will take (none left) goes back to pending."""
        ready = self.ready.get(stage)
        if not ready:
            self._claim_if_low(stage)
            return
        registry = self.registry
        if not registry.count(stage):
            self._unready(stage)
            return
        single = self.single_active(stage)
        acked: list[tuple[str, int]] = []
        now = self.clock()
        active = registry.active(registry.of(stage), single)
        if len(active) == 1:  # the common case: one run, as far as its credit goes
            owner: Sender = active[0].book.owner  # type: ignore[assignment]
            sent_bytes, expired, parts = self._pump_one(stage, ready, active[0], now, acked)
            frames = {id(owner): (owner, parts)} if parts else {}
        else:
            sent_bytes, expired, frames = self._pump_turns(stage, ready, single, now, acked)
        if not sent_bytes and not frames:
            return
        self._ready_bytes[stage] = self._ready_bytes.get(stage, 0) - sent_bytes
        for sender, parts in frames.values():
            self.delivered += len(parts)
            sender.send_frames(b"".join(parts))
        if acked or expired:
            self._outcomes.acked += acked
            self._settle_soon()
        self._claim_if_low(stage)

    def _pump_turns(
        self, stage: str, ready: deque[Fetched], single: bool, now: float,
        acked: list[tuple[str, int]],
    ) -> tuple[int, bool, dict[int, tuple[Sender, list[bytes]]]]:  # fmt: skip
        """`pump` for several consumers: round robin, one message per turn, as far as their
        credit goes. The bytes taken from the read-ahead, whether some had expired, and the
        frames to send, per channel."""
        frames: dict[int, tuple[Sender, list[bytes]]] = {}
        sent_bytes = 0
        expired = False
        while ready:
            consumer = self.registry.pick(stage, single)
            if consumer is None:
                break
            taken, gone, parts = self._pump_one(stage, ready, consumer, now, acked, most=1)
            sent_bytes += taken
            expired = expired or gone
            if parts:
                sender: Sender = consumer.book.owner  # type: ignore[assignment]
                out = frames.get(id(sender))
                if out is None:
                    out = frames[id(sender)] = (sender, [])
                out[1].extend(parts)
        return sent_bytes, expired, frames

    def _pump_one(
        self,
        stage: str,
        ready: deque[Fetched],
        consumer: Consumer,
        now: float,
        acked: list[tuple[str, int]],
        *,
        most: int | None = None,
    ) -> tuple[int, bool, list[bytes]]:
        """What `consumer`'s credit allows (at `most` messages), taken from the read-ahead
        in one run: its credit counted down here instead of asked per message, its book
        written directly; expired messages go to be dead-lettered on the way. The bytes
        taken from the read-ahead, whether some had expired, and the frames to send."""
        book = consumer.book
        # A no-ack consumer's credit does not go down as it is sent messages: all of them.
        credit = len(ready) if consumer.no_ack and consumer.credit() else consumer.credit()
        if most is not None:
            credit = min(credit, most)
        if not credit:
            return 0, False, []
        sender: Sender = book.owner  # type: ignore[assignment]
        encode = sender.delivery_frames
        parts: list[bytes] = []
        unacked = book.unacked
        tag = book.next_tag
        sent_bytes = 0
        expired = False
        while credit and ready:
            fetched = ready.popleft()
            sent_bytes += len(fetched.body)
            if fetched.expires is not None and fetched.expires <= now:  # expired read ahead
                self._outcomes.dead.append((stage, fetched.wid, "expired"))
                expired = True
                continue
            parts.append(encode(consumer, tag, fetched))
            if consumer.no_ack:
                acked.append((stage, fetched.wid))
            else:
                unacked[tag] = Delivery(fetched.wid, stage, consumer.tag, fetched.delivery_count)
                consumer.unacked += 1
            tag += 1
            credit -= 1
        book.next_tag = tag
        return sent_bytes, expired, parts

    def _claim_if_low(self, stage: str) -> None:
        """Wake the dispatcher when the stage's read-ahead is down to half of what its
        consumers should have (`capacities` then asks for the rest), and only then: a
        dispatcher cycle per burst of acks cost more than the claims."""
        target = self.registry.target(stage, self.single_active(stage))
        have = len(self.ready.get(stage, ())) + self._loading.get(stage, 0)
        if target and have * 2 <= target:
            self.link.wake("amqp")

    def pump_all(self) -> None:
        """A client reads again: every stage's read-ahead may move."""
        for stage in list(self.ready):
            self.pump(stage)

    def credit_freed(self, book: ChannelBook) -> None:
        """An ack, nack, reject, recover or qos on this channel: its consumers may take
        more. Sent once the frames read meanwhile are handled (acks come in bursts): one
        write for the lot."""
        for consumer in book.consumers.values():
            self._to_pump.add(consumer.stage)
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self._pump_later)

    def _pump_later(self) -> None:
        self._pump_scheduled = False
        stages, self._to_pump = self._to_pump, set()
        for stage in stages:
            self.pump(stage)

    def takes_now(self, stage: str) -> bool:
        """Whether a message published to `stage` now would go straight to a consumer:
        its consumers have room for it beyond what is read ahead or loading before it
        (RabbitMQ's x-message-ttl = 0 delivers then, and only then)."""
        ahead = len(self.ready.get(stage, ())) + self._loading.get(stage, 0)
        room = 0
        for consumer in self.registry.of(stage):
            room += consumer.credit()
            if room > ahead:
                return True
        return False

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

    # ---- outcomes -----------------------------------------------------------------------

    def ack(self, deliveries: Iterable[Delivery]) -> None:
        self._outcomes.acked += [(d.stage, d.wid) for d in deliveries]
        self._settle_soon()

    def ack_one(self, delivery: Delivery) -> None:
        """`ack` of one delivery (a consumer's basic.ack, one per message)."""
        self._outcomes.acked.append((delivery.stage, delivery.wid))
        self._settle_soon()

    def requeue(self, deliveries: Iterable[Delivery]) -> None:
        """Returned by the consumer (or its channel closed): redelivered later, unless the
        queue's delivery limit is reached, then dead-lettered. The stage's read-ahead goes
        back too, so that the returned message is first again, as in RabbitMQ."""
        stages: set[str] = set()
        for d in deliveries:
            stages.add(d.stage)
            queue = self.queues.get(d.stage)
            limit = queue.arguments.delivery_limit if _quorum(queue) and queue else None
            if limit is not None and d.delivery_count + 1 > limit:
                self._outcomes.dead.append((d.stage, d.wid, "delivery_limit"))
            else:
                self._outcomes.returned.append((d.stage, d.wid))
                self._returned(d.stage)
        for stage in stages:
            self._unready(stage)
        self._settle_soon()

    def dead_letter(self, queue: Queue, ids: Iterable[int], reason: str) -> None:
        """Rows of `queue` this side has claimed itself (status running, held by no
        consumer: an expiry sweep's) to dead-letter for `reason` with the next commit."""
        self.queues.setdefault(queue.stage, queue)
        self._outcomes.dead += [(queue.stage, wid, reason) for wid in ids]
        self._settle_soon()

    def reject(self, deliveries: Iterable[Delivery]) -> None:
        self._outcomes.dead += [(d.stage, d.wid, "rejected") for d in deliveries]
        self._settle_soon()

    def unsent(self, stage: str, ids: Iterable[int]) -> None:
        for wid in ids:
            self._outcomes.unsent.append((stage, wid))
            self._returned(stage)
        self._settle_soon()

    def _returned(self, stage: str) -> None:
        self._returning[stage] = self._returning.get(stage, 0) + 1
        self._epoch[stage] = self._epoch.get(stage, 0) + 1

    def _settle_soon(self) -> None:
        self._start()
        self._settle_wake.set()
        if self._gathering and not worth_gathering(
            self._outcomes, awaited=bool(self._barriers), closing=self._closing
        ):
            self._gather_cut.set()  # a return, a reject, a flush or enough acks: write now

    async def flush(self) -> None:
        """Return once every outcome recorded so far is written (a channel's methods are
        ordered: a get after a nack must see the nacked message back)."""
        if not self._outcomes and not self._in_settle:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers.append(waiter)
        self._settle_soon()
        await waiter

    # ---- basic.get ----------------------------------------------------------------------

    async def get(self, queue: Queue) -> tuple[Fetched, int] | None:
        """Claim the queue's oldest ready message: (it, how many stay ready), or None."""
        self.queues[queue.stage] = queue
        await self.flush()
        stage = queue.stage
        ahead = self.take_ready(stage)
        if ahead is not None:  # consumers read ahead: the head of the queue is here
            conn = await self._connection("fetch")
            cur = await conn.execute(query("amqp_queue_message_count"), {"stage": stage})
            row = await cur.fetchone()
            return ahead, (int(row[0]) if row else 0) + self.ready_count(stage)
        while True:
            conn = await self._connection("fetch")
            try:
                async with conn.transaction():
                    cur = await conn.execute(
                        query("amqp_get"), {"stage": queue.stage}, binary=True
                    )  # as amqp_delivery_load: the body as bytes, not hex
                    row = await cur.fetchone()
            except psycopg.OperationalError:
                await self._drop("fetch")
                raise
            if row is None:
                return None
            fetched = fetched_row(row, queue.name, _quorum(queue))
            if not fetched.expired(self.clock()):
                return fetched, max(int(row[11]), 0) + self.ready_count(stage)
            self._outcomes.dead.append((queue.stage, fetched.wid, "expired"))
            self._settle_soon()

    # ---- tasks --------------------------------------------------------------------------

    def _start(self) -> None:
        if self._tasks or self._closing:
            return
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._fetch_loop(), name="amqp deliveries"),
            loop.create_task(self._settle_loop(), name="amqp outcomes"),
        ]

    async def close(self) -> None:
        """Write every outcome still waiting, then stop (the listener has stopped)."""
        self._closing = True
        for stage in list(self.ready):
            self._unready(stage)
        if self._tasks:
            self._fetch_wake.set()
            self._settle_wake.set()
            self._gather_cut.set()  # what waits is written now
            await asyncio.wait(self._tasks, timeout=10)
            for task in self._tasks:
                task.cancel()
        for name in ("fetch", "settle"):
            await self._drop(name)

    async def _connection(self, name: str) -> AConn:
        attr = f"_{name}_conn"
        conn: AConn | None = getattr(self, attr)
        if conn is None or conn.closed:
            conn = await connect_async(
                self.dsn, application_name=APPLICATION_NAME, timeout=self.connect_timeout
            )
            await conn.set_autocommit(True)
            if name == "settle":
                # An outcome lost with a crash is a redelivery, which at-least-once
                # allows (the client's ack is never waited for): no fsync per commit.
                await conn.execute(query("amqp_outcomes_async_commit"))
            setattr(self, attr, conn)
        return conn

    async def _drop(self, name: str) -> None:
        attr = f"_{name}_conn"
        conn: AConn | None = getattr(self, attr)
        setattr(self, attr, None)
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

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
            left = self._loading.get(stage, 0) - count
            if left > 0:
                self._loading[stage] = left
            else:
                self._loading.pop(stage, None)
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
        return queue.name if queue else stage, _quorum(queue), ready

    async def _settle_loop(self) -> None:
        delays = self.backoff.delays()
        while True:
            if not self._outcomes:
                waiting, self._barriers = self._barriers, []
                for waiter in waiting:  # nothing left unwritten
                    if not waiter.done():
                        waiter.set_result(None)
                if self._closing and not self._claimed:
                    return
                self._settle_wake.clear()
                await self._settle_wake.wait()
                continue
            if worth_gathering(self._outcomes, awaited=bool(self._barriers), closing=self._closing):
                self._gathering = True
                self._gather_cut.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._gather_cut.wait(), SETTLE_GATHER_SECONDS)
                self._gathering = False
            batch = self._outcomes.take(MAX_SETTLE_BATCH)
            barriers: list[asyncio.Future[None]] = []
            if not self._outcomes:  # everything recorded so far is in this batch
                barriers, self._barriers = self._barriers, []
            self._in_settle = batch.ids()
            try:
                await self._write(batch)
            except (psycopg.Error, PepsiError, OSError) as error:
                log.error(
                    "amqp: could not record %d consumer outcomes: %s", len(batch), one_line(error)
                )
                self._outcomes.put_back(batch)
                self._barriers[:0] = barriers
                await self._drop("settle")
                if self._closing:
                    return  # the next start resets them (they stay running): redelivered
                await asyncio.sleep(next(delays))
                continue
            finally:
                self._in_settle = []
            delays = self.backoff.delays()
            self._report(batch)
            for waiter in barriers:
                if not waiter.done():
                    waiter.set_result(None)

    async def _write(self, batch: Outcomes) -> None:
        conn = await self._connection("settle")
        settle = batch.acked or batch.returned or batch.unsent
        params = {
            "acked": id_array(w for _, w in batch.acked),
            "returned": id_array(w for _, w in batch.returned),
            "unsent": id_array(w for _, w in batch.unsent),
        }
        if not batch.dead:
            # the common case: one statement, its own transaction (autocommit), one round
            # trip instead of three
            await conn.execute(query("amqp_settle"), params)
            return
        async with conn.transaction():
            if settle:
                await conn.execute(query("amqp_settle"), params)
            await self._dead_letter(conn, batch.dead)

    async def _dead_letter(self, conn: AConn, dead: list[tuple[str, int, str]]) -> None:
        reasons = {wid: reason for _, wid, reason in dead}
        cur = await conn.execute(query("amqp_dead_letter_load"), {"ids": list(reasons)})
        letters = []
        for row in await cur.fetchall():
            letters.append(await self._letter(row, reasons[int(row[0])]))
        if letters:
            await conn.execute(query("amqp_dead_letter"), {"rows": json.dumps(letters)})

    async def _letter(self, row: Sequence[Any], reason: str) -> dict[str, Any]:
        """One row's dead letter (`amqp_dead_letter_load`'s columns): where it goes, its
        new state and properties."""
        wid, stage = int(row[0]), str(row[1])
        properties: dict[str, Any] = row[2] or {}
        state: dict[str, Any] = row[3] or {}
        header: bytes | None = row[4]
        queue = self.queues.get(stage)
        exchange = str(properties.get("exchange", ""))
        routing_key = str(properties.get("routing_key", ""))
        stages: list[str] = []
        ttls: dict[str, int] = {}
        new_properties = properties
        args = queue.arguments if queue is not None else None
        deaths = list(state.get("x_death") or [])
        if not deaths and header is not None:
            with contextlib.suppress(ValueError):
                deaths = dead_letters.deaths_from_header(
                    headers.header_entry(bytes(header), "x-death")
                )
        expiration = None
        if header is not None:
            with contextlib.suppress(ValueError):
                expiration = headers.expiration(bytes(header))
        deaths = dead_letters.record_death(
            deaths,
            queue=queue.name if queue is not None else stage,
            reason=reason,
            exchange=exchange,
            routing_keys=[routing_key],
            now=self.clock(),
            original_expiration=expiration,  # RabbitMQ: the property goes, the entry keeps it
        )
        new_state = {k: v for k, v in state.items() if k not in _NOT_CARRIED}
        new_state["x_death"] = deaths
        new_state.setdefault("x_first_death", {
            "reason": reason, "queue": deaths[0]["queue"], "exchange": exchange,
        })  # fmt: skip
        if args is not None and args.dead_letter_exchange is not None and self.dead_letter_route:
            key = args.dead_letter_routing_key
            keys = [routing_key] if key is None else [key]
            decoded = None
            if header is not None:
                with contextlib.suppress(ValueError):
                    decoded = decode_properties(bytes(header)).headers
            stages, ttls = await self.dead_letter_route(
                stage, args.dead_letter_exchange, keys, decoded
            )
            # RabbitMQ's cycle rule: an automatic dead letter never returns to its own queue
            stages = [s for s in stages if reason == "rejected" or s != stage]
            new_properties = {
                **properties,
                "exchange": args.dead_letter_exchange,
                "routing_key": keys[0],
            }
        return {
            "workqueue_id": wid,
            "stages": stages,
            "ttls": [ttls.get(s) for s in stages],  # each queue's x-message-ttl from now on
            "state": new_state,
            "properties": new_properties,
            "reason": reason,
        }

    def _report(self, batch: Outcomes) -> None:
        for stage, _ in (*batch.returned, *batch.unsent):
            left = self._returning.get(stage, 0) - 1
            if left > 0:
                self._returning[stage] = left
            else:
                self._returning.pop(stage, None)
        for kind, pairs in (("consumed", batch.acked), ("returned", batch.returned),
                            ("returned", batch.unsent)):  # fmt: skip
            by_stage: dict[str, list[int]] = {}
            for stage, wid in pairs:
                by_stage.setdefault(stage, []).append(wid)
            for stage, ids in by_stage.items():
                getattr(self.link, kind)(stage, ids)
        dead: dict[str, list[int]] = {}
        for stage, wid, _ in batch.dead:
            dead.setdefault(stage, []).append(wid)
        for stage, ids in dead.items():
            self.link.consumed(stage, ids)
        if batch.returned or batch.unsent or batch.dead:
            self.link.wake("amqp")  # ready again (here or in a dead-letter queue)


__all__ = ["Deliverer", "DispatchLink", "Fetched", "NoDispatch", "fetched_row"]
