"""The AMQP 0-9-1 listener the dispatcher serves on `[pepsi-amqp] LISTEN` (issue 16).

`Server` accepts connections (`connection.Connection`, one per client), keeps the
open ones for `set_blocked` (the dispatcher's back-pressure hook) and closes
them all at `stop` (320 CONNECTION_FORCED, as RabbitMQ at shutdown).
`Catalogue` is the `Gatekeeper` over PostgreSQL: users and permissions are read
on one connection of its own (application name `pepsi-amqp`), opened on first
use and again after a loss, so the loop never waits on the claim connection;
the scrypt check runs on a thread, a few at a time (each takes ~16 MiB).

A connection's failure is logged and ends that connection; the server goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg

from pepsi.amqp.auth.permissions import Credentials, Permission, can_open_vhost, login_refusal
from pepsi.amqp.session.connection import Connection
from pepsi.amqp.session.handler import Broker, NoBroker
from pepsi.amqp.session.memory import PublishMemory
from pepsi.amqp.session.negotiation import connection_refusal
from pepsi.amqp.session.shell import ConnectionOptions
from pepsi.amqp.wire import replies
from pepsi.db.connect import connect_async
from pepsi.db.queries import query
from pepsi.errors import PepsiError, one_line

log = logging.getLogger("pepsi.amqp")

APPLICATION_NAME = "pepsi-amqp"
VERIFY_CONCURRENCY = 4  # password checks at once (memory: 16 MiB each)
STOP_GRACE = 5.0  # at stop: how long connections get to finish their current frame

_OPEN_CLASS, _OPEN_METHOD = 10, 40  # connection.open, named in its 530 refusals


class CatalogueUnavailable(replies.AMQPConnectionError):
    """The user database cannot be read: the login cannot be decided (541)."""


class Catalogue:
    """Logins and vhost access read from pepsi.amqp_user / amqp_vhost / amqp_permission."""

    def __init__(self, dsn: str, connect_timeout: float) -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self._lock = asyncio.Lock()  # one statement at a time on the connection
        # scrypt on threads of its own, never the loop's default executor, which config
        # reloads and the console's reads share: a flood of logins elsewhere (the web
        # console's) cannot queue in front of an AMQP login, nor these in front of theirs
        self._verify = ThreadPoolExecutor(VERIFY_CONCURRENCY, thread_name_prefix="pepsi-amqp-auth")

    async def _fetch(self, name: str, params: dict[str, str]) -> tuple[Any, ...] | None:
        async with self._lock:
            for attempt in (1, 2):  # a connection lost since the last login: one retry
                try:
                    if self._conn is None or self._conn.closed:
                        self._conn = await connect_async(
                            self.dsn,
                            application_name=APPLICATION_NAME,
                            timeout=self.connect_timeout,
                        )
                    cursor = await self._conn.execute(query(name), params)
                    return await cursor.fetchone()
                except (psycopg.OperationalError, PepsiError) as error:
                    await self._drop()
                    if attempt == 2:
                        log.error("amqp: cannot read the user database: %s", one_line(error))
                        raise CatalogueUnavailable(
                            replies.INTERNAL_ERROR, "cannot read the user database"
                        ) from None
        raise AssertionError("unreachable")  # pragma: no cover

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(psycopg.Error):  # already gone
                await conn.close()

    async def login(self, credentials: Credentials, peer: str | None) -> str | None:
        row = await self._fetch("amqp_user_get", {"name": credentials.username})
        stored = None if row is None else str(row[1])
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._verify, login_refusal, credentials, stored, peer)

    async def vhost_permission(self, username: str, vhost: str) -> Permission:
        row = await self._fetch("amqp_vhost_exists", {"name": vhost})
        if not (row and row[0]):
            raise replies.AMQPConnectionError(
                replies.NOT_ALLOWED, f"vhost {vhost} not found", _OPEN_CLASS, _OPEN_METHOD
            )
        row = await self._fetch("amqp_permission_get", {"username": username, "vhost": vhost})
        permission = None if row is None else Permission(str(row[0]), str(row[1]), str(row[2]))
        if permission is None or not can_open_vhost(permission):
            raise replies.AMQPConnectionError(
                replies.NOT_ALLOWED,
                f"access to vhost '{vhost}' refused for user '{username}'",
                _OPEN_CLASS,
                _OPEN_METHOD,
            )
        return permission

    async def vhost_exists(self, name: str) -> bool:
        row = await self._fetch("amqp_vhost_exists", {"name": name})
        return bool(row and row[0])

    async def user_exists(self, name: str) -> bool:
        return await self._fetch("amqp_user_get", {"name": name}) is not None

    async def close(self) -> None:
        async with self._lock:
            await self._drop()
        self._verify.shutdown(wait=False)


def _of_user(user: str) -> Callable[[Connection], bool]:
    return lambda conn: conn.username == user


class Server:
    """The listening socket and its connections."""

    def __init__(
        self,
        options: ConnectionOptions,
        catalogue: Catalogue,
        broker: Broker | None = None,
    ) -> None:
        self.options = options
        self.catalogue = catalogue
        self.broker: Broker = broker if broker is not None else NoBroker()
        self.connections: set[Connection] = set()  # every accepted one, until it is gone
        self.open: set[Connection] = set()  # those past connection.open-ok
        self.blocked_reason: str | None = None
        self._blocked_by: dict[str, str] = {}  # why clients are blocked, by source
        # bodies being received by every connection (PUBLISH_BUFFER): one bound for all
        self.memory = PublishMemory(options.amqp.publish_buffer)
        self.memory.on_blocked = lambda reason: self._blocked_for("memory", reason)
        self._server: asyncio.Server | None = None
        self._changes: set[asyncio.Task[None]] = set()

    def _connection(self) -> Connection:
        conn = Connection(
            self.options,
            self.catalogue,
            self.broker,
            opened=self.open.add,
            gone=self._gone,
            blocked=lambda: self.blocked_reason,
            admit=self._admit,
            publish_memory=self.memory,
        )
        self.connections.add(conn)
        return conn

    def _admit(self, conn: Connection) -> str | None:
        others = [c for c in self.connections if c is not conn]
        amqp = self.options.amqp
        return connection_refusal(
            len(others),
            sum(1 for c in others if c.peer == conn.peer),
            max_connections=amqp.max_connections,
            client_limit=amqp.client_connection_limit,
        )

    def _gone(self, conn: Connection) -> None:
        self.connections.discard(conn)
        self.open.discard(conn)

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._connection, host, port, reuse_address=True)

    @property
    def address(self) -> tuple[str, int]:
        """The first bound address (the port chosen for port 0)."""
        assert self._server is not None
        assert self._server.sockets
        name = self._server.sockets[0].getsockname()
        return str(name[0]), int(name[1])

    def changed(self, payload: str) -> None:
        """NOTIFY amqp_changed (`pepsi amqp`, the catalogue's writes): act on it soon."""
        try:
            change = json.loads(payload)
        except ValueError:
            return
        if isinstance(change, dict):
            task = asyncio.get_running_loop().create_task(self._apply_change(change))
            self._changes.add(task)
            task.add_done_callback(self._changes.discard)

    async def _apply_change(self, change: dict[str, Any]) -> None:
        """A vhost or user deleted: its connections go (320, as rabbitmqctl does); changed
        permissions apply to the next operation, or end the connection if none are left;
        a vhost's catalogue is read again."""
        kind, name = change.get("kind"), str(change.get("name", ""))
        vhost = change.get("vhost")
        catalogue = getattr(self.broker, "catalogue", None)
        if kind in ("catalogue", "vhost") and catalogue is not None:
            catalogue.forget(str(vhost) if kind == "catalogue" else name)
        try:
            if kind == "resync":  # notifications may have been missed: check every one
                await self._resync()
            elif kind == "vhost" and not await self.catalogue.vhost_exists(name):
                self._force(lambda c: c.vhost == name, f"vhost '{name}' is deleted")
            elif kind == "user" and not await self.catalogue.user_exists(name):
                self._force(lambda c: c.username == name, f"user '{name}' is deleted")
            elif kind == "permissions" and vhost is not None:
                await self._permissions_changed(name, str(vhost))
        except replies.AMQPError:
            log.warning(
                "amqp: could not apply a change of %s %r (database unavailable)", kind, name
            )

    async def _resync(self) -> None:
        users = {c.username for c in self.open if c.username is not None}
        gone = {user for user in users if not await self.catalogue.user_exists(user)}
        for user in gone:
            self._force(_of_user(user), f"user '{user}' is deleted")
        for user, vhost in {(c.username, c.vhost) for c in self.open if c.username and c.vhost}:
            await self._permissions_changed(user, vhost)

    async def _permissions_changed(self, user: str, vhost: str) -> None:
        affected = [c for c in self.open if c.username == user and c.vhost == vhost]
        if not affected:
            return
        try:
            permission = await self.catalogue.vhost_permission(user, vhost)
        except replies.AMQPConnectionError:  # none left (or the vhost is gone)
            self._force(
                lambda c: c in affected, f"access to vhost '{vhost}' refused for user '{user}'"
            )
            return
        for conn in affected:
            conn.permission = permission
            for channel in conn.channels.values():
                forget = getattr(channel.handler, "permissions_changed", None)
                if forget is not None:
                    forget()

    def _force(self, which: Callable[[Connection], bool], why: str) -> None:
        for conn in [c for c in self.open if which(c)]:
            log.info("amqp %s: closing the connection: %s", conn.name, why)
            conn.shutdown(f"broker forced connection closure with reason '{why}'")

    def set_blocked(self, reason: str | None) -> None:
        """Back-pressure starts (a reason) or ends (None): connection.blocked / unblocked
        to every open connection whose client announced the capability."""
        self._blocked_for("publishing", reason)

    def _blocked_for(self, source: str, reason: str | None) -> None:
        if reason is None:
            self._blocked_by.pop(source, None)
        else:
            self._blocked_by[source] = reason
        self.blocked_reason = "; ".join(self._blocked_by.values()) or None
        for conn in list(self.open):
            conn.set_blocked(self.blocked_reason)

    async def stop(self) -> None:
        """Stop accepting, close every connection (320), wait briefly for them to end."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self.connections):
            conn.shutdown()
        tasks = [c.task for c in list(self.connections) if c.task is not None and not c.task.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=STOP_GRACE)
            if pending:  # a client that does not read what is still buffered for it
                for conn in list(self.connections):
                    conn.abort()
                _, pending = await asyncio.wait(pending, timeout=STOP_GRACE)
            for task in pending:
                task.cancel()
        await self.catalogue.close()


async def serve(
    address: tuple[str, int],
    options: ConnectionOptions,
    dsn: str,
    connect_timeout: float,
    broker: Broker | None = None,
) -> Server:
    """A started server (OSError if the address cannot be bound)."""
    server = Server(options, Catalogue(dsn, connect_timeout), broker)
    await server.start(*address)
    return server


__all__ = ["Catalogue", "ConnectionOptions", "Server", "serve"]
