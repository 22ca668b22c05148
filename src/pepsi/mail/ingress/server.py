"""`pepsi ingress --serve`: the SMTP and LMTP listeners, their publisher, their lifetime.

One process serves every address of `[pepsi-ingress] LISTEN` (SMTP) and
`LMTP_LISTEN` (LMTP, on TCP or a UNIX socket); several processes may serve
one database, and one port (`SO_REUSEPORT`). It stops on SIGTERM or SIGINT:
no new connection is taken, the commits under way end and get their reply,
then every session is told `421` and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pwd
import resource
import signal
import socket
import ssl
import stat
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pepsi import eventloop
from pepsi.admin.accounts import mail_users
from pepsi.amqp.auth import passwords
from pepsi.config import Config
from pepsi.config.values import host_port
from pepsi.db import connect as db_connect
from pepsi.errors import EX_OK, ConfigError, PepsiError
from pepsi.mail.ingress.committer import Committer
from pepsi.mail.ingress.connection import Ingress, skip_dropped_command_logs
from pepsi.mail.ingress.session import LmtpSession, SmtpSession
from pepsi.mail.protocol import replies
from pepsi.publishing.async_client import AsyncPublisher

log = logging.getLogger("pepsi.ingress")

SHUTDOWN_GRACE = 10.0  # seconds the commits under way get at shutdown
LISTEN_BACKLOG = 1024
SOCKET_MODE = 0o660  # the LMTP socket: its owner and group may hand over mail
PASSWORD_CHECKS = 2  # scrypt checks at once, on threads of their own (never the loop's)


def tls_context(config: Config) -> ssl.SSLContext | None:
    """The STARTTLS context from TLS_CERT and TLS_KEY; ConfigError (78) if they cannot load."""
    options = config.ingress
    if options.tls_cert is None or options.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(options.tls_cert, options.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"cannot load the certificate and key: {exc}",
            file=str(config.path) if config.path else None,
            section="pepsi-ingress",
            key="TLS_CERT",
        ) from None
    return context


def raise_file_limit(wanted: int) -> None:
    """Let the process hold `wanted` sockets: the soft limit of open files up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def peer_login(sock: socket.socket | None) -> str:
    """The login of a UNIX socket's peer, from its credentials (SO_PEERCRED)."""
    if sock is None:
        return "unknown"
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


class IngressServer:
    """The listeners, the publisher they commit through, and an orderly stop."""

    def __init__(self, config: Config) -> None:
        options = config.ingress
        if options.stage is None or not (options.listen or options.lmtp_listen):
            raise ConfigError(
                "nothing to serve: set LISTEN (SMTP) or LMTP_LISTEN, and STAGE",
                file=str(config.path) if config.path else None,
                section="pepsi-ingress",
            )
        self.config = config
        self.stage = options.stage
        self.tls = tls_context(config)
        self.hostname = options.hostname or socket.getfqdn()
        self.servers: list[asyncio.Server] = []
        self.addresses: list[str] = []
        self.hashing = ThreadPoolExecutor(PASSWORD_CHECKS, thread_name_prefix="pepsi-auth")

    async def run(self, stop: asyncio.Event) -> int:
        config = self.config
        dsn = (await asyncio.to_thread(db_connect.resolve, config)).dsn
        # A commit that waits longer than TIMEOUT for its confirm (a cluster without its
        # quorum) is answered 451: the client keeps the message and tries again.
        publisher = AsyncPublisher(config, dsn, confirm_timeout=config.ingress.timeout)
        await publisher.open()
        committer = Committer(publisher)
        committer.start()

        async def check_login(name: str, password: bytes) -> bool:
            async with publisher.pool.connection() as conn:
                stored = await mail_users.stored_hash(conn, name)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.hashing, passwords.verify, password, stored)

        ingress = Ingress(
            options=config.ingress,
            stage=self.stage,
            hostname=self.hostname,
            committer=committer,
            check_login=check_login,
            tls=self.tls,
        )
        raise_file_limit(config.ingress.max_connections + 64)
        try:
            try:
                await self._listen(ingress)
            except OSError as exc:  # a port in use, an address not on this host, a bad path
                raise PepsiError(f"cannot listen: {exc.strerror or exc}") from None
            log.info(
                "pepsi-ingress: accepting mail for stage %s on %s",
                self.stage,
                ", ".join(self.addresses),
            )
            await stop.wait()
            log.info("pepsi-ingress: stopping")
            await self._stop(ingress)
        finally:
            await committer.close()
            await publisher.close()
            self.hashing.shutdown(wait=False)
        log.info(
            "pepsi-ingress: stopped: %d messages stored in %d commits since start",
            committer.stored,
            committer.commits,
        )
        return EX_OK

    async def _listen(self, ingress: Ingress) -> None:
        loop = asyncio.get_running_loop()
        options = ingress.options
        for host, port in options.listen:
            server = await loop.create_server(
                lambda: SmtpSession(ingress),
                host,
                port,
                reuse_port=True,
                backlog=LISTEN_BACKLOG,
            )
            self._serving("smtp", server)
        lmtp = options.lmtp_listen
        if isinstance(lmtp, Path):
            _remove_stale_socket(lmtp)
            server = await loop.create_unix_server(
                _unix_factory(ingress), str(lmtp), backlog=LISTEN_BACKLOG
            )
            lmtp.chmod(SOCKET_MODE)
            self._serving("lmtp", server)
        elif lmtp is not None:
            server = await loop.create_server(
                lambda: LmtpSession(ingress), lmtp[0], lmtp[1], reuse_port=True
            )
            self._serving("lmtp", server)

    def _serving(self, kind: str, server: asyncio.Server) -> None:
        self.servers.append(server)
        for sock in server.sockets:
            name = sock.getsockname()
            where = name if isinstance(name, str) else host_port(name[0], name[1])
            self.addresses.append(f"{kind} {where}")

    async def _stop(self, ingress: Ingress) -> None:
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SHUTDOWN_GRACE
        while any(s.committing for s in ingress.sessions) and loop.time() < deadline:
            await asyncio.sleep(0.05)  # a commit under way gets its reply
        for session in list(ingress.sessions):
            session.goodbye(replies.SHUTTING_DOWN)
        for server in self.servers:
            await server.wait_closed()


def _unix_factory(ingress: Ingress) -> Callable[[], LmtpSession]:
    """Sessions on the UNIX socket: the peer's login comes with its first connection."""

    class LocalLmtpSession(LmtpSession):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            if self.local_user is None:
                self.local_user = peer_login(transport.get_extra_info("socket"))
                self.trusted = True
            super().connection_made(transport)

    return lambda: LocalLmtpSession(ingress)


def _remove_stale_socket(path: Path) -> None:
    """A socket file left by an earlier run is removed; any other file is not touched."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
        else:
            raise ConfigError(f"{path} exists and is not a socket", section="pepsi-ingress")


def serve(config: Config, *, verbose: bool = False) -> int:
    """Run until SIGTERM or SIGINT; the exit status. `verbose`: aiosmtpd's log too."""
    server = IngressServer(config)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        return await server.run(stop)

    if not verbose:
        logging.getLogger("mail.log").setLevel(logging.WARNING)  # aiosmtpd: a line per command
    skip_dropped_command_logs()
    return eventloop.run(main())
