"""Serving the console: `pepsi web` on its own loop, or the dispatcher on its loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pepsi.config import Config
from pepsi.errors import ConfigError
from pepsi.web.app import make_app
from pepsi.web.security import is_loopback


@dataclass
class Running:
    runner: web.AppRunner
    address: tuple[str, int]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    async def stop(self) -> None:
        await self.runner.cleanup()


def check_exposure(config: Config, host: str, *, key: str = "LISTEN") -> None:
    """A console reachable from other machines must ask for a password."""
    if config.web.password is None and not is_loopback(host):
        raise ConfigError(
            f"a console listening on {host} needs a password: set PASSWORD "
            "(`pepsi web password` prints one), or listen on 127.0.0.1",
            section="pepsi-web",
            key=key,
        )


async def start(
    config: Config, dsn: str, address: tuple[str, int], *, dispatcher: Any = None
) -> Running:
    """The console listening on `address` (port 0: a free one); OSError if it cannot bind."""
    host, port = address
    check_exposure(config, host)
    runner = web.AppRunner(make_app(config, dsn, dispatcher=dispatcher), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname() if sockets else (host, port)
    return Running(runner, (str(bound[0]), int(bound[1])))
