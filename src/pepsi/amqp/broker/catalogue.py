"""Exchanges, queues and bindings in PostgreSQL, as the broker reads and changes them.

`Catalogue` keeps one connection of its own (application name
`pepsi-amqp-catalogue`), opened on first use and again after a loss. Per vhost it
caches a `VhostView`: the exchanges, queues and bindings, and the `RoutingTable`
built from them, so a publish routes without a round trip. Every change made
through it is one transaction ending with `NOTIFY amqp_changed`, and drops that
vhost's view (the next use reads it again). Changes made by other processes
(`pepsi amqp vhost delete`) reach it through the dispatcher's LISTEN on
amqp_changed (`Server.changed` drops the view).

Arguments are stored as JSON (`amqp_*.arguments jsonb`): strings, integers, floats,
booleans, tables and arrays keep their type class; bytes, decimals and timestamps
are stored as text, so a redeclare with such a value after a restart may be found
inequivalent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from pepsi.amqp.model.arguments import QueueArguments, parse_queue_arguments
from pepsi.amqp.model.exchanges import EXCHANGE, HEADERS, QUEUE, Binding, Exchange
from pepsi.amqp.model.queues import QueueDeclaration
from pepsi.amqp.model.routing import RoutingTable
from pepsi.amqp.wire import replies
from pepsi.db.connect import connect_async
from pepsi.db.queries import query
from pepsi.errors import PepsiError, one_line

log = logging.getLogger("pepsi.amqp")

APPLICATION_NAME = "pepsi-amqp-catalogue"


@dataclass(frozen=True)
class Queue:
    """A declared queue: its declaration, its stage and its parsed arguments."""

    declaration: QueueDeclaration
    stage: str
    # a stage of [pepsi-amqp] STAGES: its [stage-NAME] MAX_LENGTH and OVERFLOW, which
    # every publish obeys, AMQP's included (its declaration carries no x-max-length)
    stage_limit: tuple[int, bool] | None = None

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def is_stage(self) -> bool:
        """A stage of the configuration ([pepsi-amqp] STAGES): its workers take its
        messages, no AMQP consumer."""
        return not self.stage.startswith("amqp:")

    @cached_property
    def arguments(self) -> QueueArguments:
        decl = self.declaration
        try:
            return parse_queue_arguments(decl.arguments, queue=decl.name, vhost=decl.vhost)
        except replies.ChannelError:  # written by hand: the queue still works, unlimited
            return QueueArguments()

    @property
    def limit(self) -> tuple[int, bool] | None:
        """(MAX_LENGTH, drop-head?) as the publish function enforces it; None: no limit."""
        if self.stage_limit is not None:
            return self.stage_limit
        args = self.arguments
        if args.max_length is None:
            return None
        return args.max_length, args.effective_overflow == "drop-head"


@dataclass(frozen=True)
class VhostView:
    """One vhost's catalogue as last read, and its routing table."""

    vhost: str
    exchanges: Mapping[str, Exchange]
    queues: Mapping[str, Queue]
    bindings: tuple[Binding, ...]

    @cached_property
    def table(self) -> RoutingTable:
        return RoutingTable(
            self.exchanges.values(), self.bindings, vhost=self.vhost, queues=self.queues.keys()
        )

    @cached_property
    def uses_headers(self) -> bool:
        """Whether routing may read a message's headers (a headers exchange has bindings)."""
        headers = {name for name, x in self.exchanges.items() if x.type == HEADERS}
        return any(b.source_exchange in headers for b in self.bindings)

    def bindings_of_source(self, exchange: str) -> list[Binding]:
        return [b for b in self.bindings if b.source_exchange == exchange]

    def sources_bound_to(self, kind: str, name: str) -> list[str]:
        return [
            b.source_exchange
            for b in self.bindings
            if b.destination_kind == kind and b.destination == name
        ]


def _json_default(value: object) -> object:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def to_json(table: Mapping[str, object] | None) -> Jsonb:
    """An AMQP field table as jsonb (see the module doc for what is not kept)."""
    text = json.dumps(dict(table or {}), default=_json_default).replace("\\u0000", "")
    return Jsonb(json.loads(text))


class Catalogue:
    """Reads and writes of exchanges, queues and bindings; a cached view per vhost."""

    def __init__(
        self,
        dsn: str,
        connect_timeout: float,
        entries: Mapping[str, str] | None = None,
        entry_limits: Mapping[str, tuple[int, bool]] | None = None,
    ) -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        # Queues of vhost / that are stages of the configuration ([pepsi-amqp] STAGES):
        # name -> stage. Their messages are rows at that stage, for its workers.
        self.entries: Mapping[str, str] = dict(entries or {})
        self.entry_limits: Mapping[str, tuple[int, bool]] = dict(entry_limits or {})
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self._lock = asyncio.Lock()  # one statement (or transaction) at a time
        self._views: dict[str, VhostView] = {}
        self._started = False

    # ---- the connection --------------------------------------------------------------

    async def _connection(self) -> psycopg.AsyncConnection[tuple[Any, ...]]:
        if self._conn is None or self._conn.closed:
            self._conn = await connect_async(
                self.dsn, application_name=APPLICATION_NAME, timeout=self.connect_timeout
            )
            if not self._started:
                self._started = True
                await self._delete_orphans(self._conn)
        return self._conn

    async def _delete_orphans(self, conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
        cur = await conn.execute(query("amqp_queue_delete_orphaned_exclusive"))
        row = await cur.fetchone()
        if row and row[0]:
            log.info("amqp: deleted %d exclusive queues of an earlier run (%d messages)", *row)

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    @contextlib.asynccontextmanager
    async def _session(self, *, write: str | None = None) -> Any:
        """The connection, in a transaction that NOTIFYs amqp_changed when `write` names a
        vhost; a database error becomes 541 INTERNAL_ERROR (it closes the connection)."""
        async with self._lock:
            try:
                conn = await self._connection()
                if write is None:
                    yield conn
                    return
                async with conn.transaction():
                    yield conn
                    payload = json.dumps({"kind": "catalogue", "vhost": write})
                    await conn.execute(query("amqp_notify_changed"), {"payload": payload})
            except (psycopg.Error, PepsiError) as error:
                if isinstance(error, psycopg.Error) and not isinstance(
                    error, psycopg.OperationalError
                ):
                    log.error("amqp: catalogue statement failed: %s", one_line(error))
                else:
                    await self._drop()
                    log.error("amqp: cannot reach the catalogue: %s", one_line(error))
                raise replies.AMQPConnectionError(
                    replies.INTERNAL_ERROR, "cannot read or write the AMQP catalogue"
                ) from None
            finally:
                if write is not None:
                    self._views.pop(write, None)

    async def close(self) -> None:
        async with self._lock:
            await self._drop()

    # ---- reads -------------------------------------------------------------------------

    def forget(self, vhost: str | None = None) -> None:
        """Drop the cached view of `vhost` (None: of every vhost)."""
        if vhost is None:
            self._views.clear()
        else:
            self._views.pop(vhost, None)

    def cached(self, vhost: str) -> VhostView | None:
        """The view of `vhost` if it is cached (the hot path: no coroutine to await)."""
        return self._views.get(vhost)

    async def view(self, vhost: str) -> VhostView:
        cached = self._views.get(vhost)
        if cached is not None:
            return cached
        params = {"vhost": vhost}
        async with self._session() as conn:
            exchanges = await (await conn.execute(query("amqp_exchange_list"), params)).fetchall()
            queues = await (await conn.execute(query("amqp_queue_list"), params)).fetchall()
            bindings = await (await conn.execute(query("amqp_binding_list"), params)).fetchall()
        view = VhostView(
            vhost,
            {
                str(n): Exchange(vhost, str(n), str(t), bool(d), bool(a), bool(i), args or {})
                for n, t, d, a, i, args in exchanges
            },
            {
                str(n): Queue(
                    QueueDeclaration(str(n), vhost, bool(d), bool(x), bool(a), args or {}),
                    self.entries.get(str(n), str(s)) if vhost == "/" else str(s),
                    self.entry_limits.get(str(n)) if vhost == "/" else None,
                )
                for n, s, d, x, a, args in queues
            },
            tuple(
                Binding(str(s), str(d), str(k), str(rk), args or {})
                for s, d, k, rk, args in bindings
            ),
        )
        self._views[vhost] = view
        return view

    async def _scalar(self, name: str, params: Mapping[str, object]) -> int:
        async with self._session() as conn:
            row = await (await conn.execute(query(name), params)).fetchone()
        return int(row[0]) if row else 0

    async def message_count(self, stage: str) -> int:
        return await self._scalar("amqp_queue_message_count", {"stage": stage})

    # ---- writes ------------------------------------------------------------------------

    async def declare_exchange(self, exchange: Exchange) -> None:
        async with self._session(write=exchange.vhost) as conn:
            await conn.execute(
                query("amqp_exchange_insert"),
                {
                    "vhost": exchange.vhost,
                    "name": exchange.name,
                    "type": exchange.type,
                    "durable": exchange.durable,
                    "auto_delete": exchange.auto_delete,
                    "internal": exchange.internal,
                    "arguments": to_json(exchange.arguments),
                },
            )

    async def delete_exchange(self, vhost: str, name: str, sources: list[str]) -> None:
        async with self._session(write=vhost) as conn:
            await conn.execute(query("amqp_exchange_delete"), {"vhost": vhost, "name": name})
            await self._auto_delete(conn, vhost, sources)

    @staticmethod
    async def _auto_delete(
        conn: psycopg.AsyncConnection[tuple[Any, ...]], vhost: str, names: list[str]
    ) -> None:
        # A deleted exchange's own bindings go too, which may empty another one: repeat.
        while names:
            cur = await conn.execute(
                query("amqp_exchange_auto_delete"), {"vhost": vhost, "names": names}
            )
            names = [str(row[0]) for row in await cur.fetchall()]

    @staticmethod
    def _binding_params(vhost: str, binding: Binding) -> dict[str, object]:
        return {
            "vhost": vhost,
            "source": binding.source_exchange,
            "destination": binding.destination,
            "destination_kind": binding.destination_kind,
            "routing_key": binding.routing_key,
            "arguments": to_json(binding.arguments),
        }

    async def bind(self, vhost: str, binding: Binding) -> None:
        async with self._session(write=vhost) as conn:
            await conn.execute(query("amqp_binding_insert"), self._binding_params(vhost, binding))

    async def unbind(self, vhost: str, binding: Binding) -> None:
        async with self._session(write=vhost) as conn:
            await conn.execute(query("amqp_binding_delete"), self._binding_params(vhost, binding))
            await self._auto_delete(conn, vhost, [binding.source_exchange])

    async def declare_queue(self, declaration: QueueDeclaration) -> str | None:
        """The new queue's stage; None if a queue of that name appeared meanwhile."""
        async with self._session(write=declaration.vhost) as conn:
            cur = await conn.execute(
                query("amqp_queue_insert"),
                {
                    "vhost": declaration.vhost,
                    "name": declaration.name,
                    "durable": declaration.durable,
                    "exclusive": declaration.exclusive,
                    "auto_delete": declaration.auto_delete,
                    "arguments": to_json(declaration.arguments),
                },
            )
            row = await cur.fetchone()
        return None if row is None else str(row[0])

    async def purge_queue(self, stage: str) -> int:
        return await self._scalar("amqp_queue_purge", {"stage": stage})

    async def transient_queues(self) -> list[tuple[str, str]]:
        """(vhost, name) of every queue that does not outlive the broker: not durable, or
        exclusive."""
        async with self._session() as conn:
            cur = await conn.execute(query("amqp_queue_transient"))
            return [(str(v), str(n)) for v, n in await cur.fetchall()]

    async def delete_queue(self, vhost: str, name: str, sources: list[str]) -> int:
        """Delete the queue and its stage's rows; how many rows went."""
        async with self._session(write=vhost) as conn:
            cur = await conn.execute(query("amqp_queue_delete"), {"vhost": vhost, "name": name})
            row = await cur.fetchone()
            await self._auto_delete(conn, vhost, sources)
        return int(row[0]) if row else 0


__all__ = ["EXCHANGE", "QUEUE", "Catalogue", "Queue", "VhostView", "to_json"]
