"""Serving the console: `pepsi web` on its own loop, or the dispatcher on its loop."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from pepsi.config import Config
from pepsi.config.values import is_loopback
from pepsi.errors import ConfigError, PepsiError
from pepsi.web import tokens
from pepsi.web.app import make_app

log = logging.getLogger("pepsi.web")


@dataclass
class Running:
    runner: web.AppRunner
    address: tuple[str, int]
    token: str | None = None  # without PASSWORD: what logs in (pepsi.web.tokens)
    published: Path | None = None  # the token's file, removed at stop

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/"

    @property
    def link(self) -> str:
        """What to open: the URL, with the token when there is one. Not for logs."""
        return tokens.link(self.url, self.token) if self.token else self.url

    async def stop(self) -> None:
        if self.published is not None:
            with contextlib.suppress(OSError):
                self.published.unlink()
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
    config: Config,
    dsn: str,
    address: tuple[str, int],
    *,
    dispatcher: Any = None,
    publish_as: str | None = None,
) -> Running:
    """The console listening on `address` (port 0: a free one); OSError if it cannot bind.
    Without PASSWORD it draws a token; `publish_as` (`pepsi web` …) writes it where
    `pepsi web url` finds it."""
    host, port = address
    check_exposure(config, host)
    token = tokens.new_token() if config.web.password is None else None
    app = make_app(config, dsn, dispatcher=dispatcher, token=token, listen_host=host)
    if not is_loopback(host) and not (config.web.public_url or "").startswith("https:"):
        log.warning(
            "web: the console at %s speaks plain HTTP off loopback: put a TLS proxy in front "
            "and set [pepsi-web] PUBLIC_URL = https://… (docs/web.md)",
            host,
        )
    runner = web.AppRunner(app, access_log=None)
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
    running = Running(runner, (str(bound[0]), int(bound[1])), token)
    if token is not None and publish_as is not None:
        try:
            console = tokens.Console(os.getpid(), running.link, publish_as)
            running.published = tokens.publish(console, running.address[1])
        except (OSError, RuntimeError) as exc:
            await runner.cleanup()
            raise PepsiError(
                f"cannot keep the console's token in {tokens.folder()}: {exc}"
            ) from None
    return running
