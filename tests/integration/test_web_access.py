"""The console refuses what it must (issue 17): an unauthenticated request, a cross-site
POST, a POST without its form token, a wrong password, and a console exposed beyond
this machine without a password. A real server on an ephemeral port, the test database."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from pepsi.amqp.passwords import hash_password
from pepsi.config import Config
from pepsi.config.parse import parse_config, parse_ini
from pepsi.errors import ConfigError
from pepsi.web import server

PASSWORD = "console-secret"
HASH = hash_password(PASSWORD, log2_n=10)  # a cheap hash: the test checks the rules


def config(web: str = "") -> Config:
    return parse_config(
        parse_ini("[stage-a]\nHANDLER = tests.stages:noop\n[pepsi-web]\n" + web, "test")
    )


def run(
    cfg: Config, dsn: str, scenario: Callable[[aiohttp.ClientSession, str], Awaitable[Any]]
) -> Any:
    async def main() -> Any:
        running = await server.start(cfg, dsn, ("127.0.0.1", 0))
        try:
            jar = aiohttp.CookieJar(unsafe=True)  # keep cookies for an IP address
            async with aiohttp.ClientSession(cookie_jar=jar) as http:
                return await scenario(http, running.url.rstrip("/"))
        finally:
            await running.stop()

    return asyncio.run(main())


def test_every_page_needs_a_login_and_a_cross_site_post_is_refused(dsn: str) -> None:
    cfg = config(f"PASSWORD = {HASH}\n")

    async def scenario(http: aiohttp.ClientSession, base: str) -> None:
        async with http.get(f"{base}/", allow_redirects=False) as page:
            assert page.status == 303
            assert page.headers["Location"].startswith("/login")
        async with http.post(f"{base}/logout", headers={"Origin": base}) as post:
            assert post.status == 401  # no session: a POST is not even considered
        form = {"password": "wrong", "next": "/"}
        async with http.post(f"{base}/login", data=form, headers={"Origin": base}) as bad:
            assert bad.status == 401
            assert "wrong password" in await bad.text()
        form["password"] = PASSWORD
        async with http.post(
            f"{base}/login", data=form, headers={"Origin": "http://evil.example"}
        ) as forged:
            assert forged.status == 403  # a login from another site's form
        async with http.post(
            f"{base}/login", data=form, headers={"Origin": base}, allow_redirects=False
        ) as ok:
            assert ok.status == 303
            cookie = ok.cookies["pepsi_session"]
            assert cookie["httponly"]
            assert cookie["samesite"] == "Strict"
        async with http.get(f"{base}/") as page:
            assert page.status == 200
            assert page.headers["X-Frame-Options"] == "DENY"
            assert "script-src 'self'" in page.headers["Content-Security-Policy"]
        # logged in, but a POST from another site, or without the form's token
        async with http.post(
            f"{base}/logout", data={}, headers={"Origin": "http://evil.example"}
        ) as cross:
            assert cross.status == 403
        async with http.post(f"{base}/logout", data={}, headers={"Origin": base}) as tokenless:
            assert tokenless.status == 403
            assert "form token" in await tokenless.text()

    run(cfg, dsn, scenario)


def test_without_a_password_the_console_is_read_only_and_for_this_machine(dsn: str) -> None:
    async def scenario(http: aiohttp.ClientSession, base: str) -> None:
        async with http.get(f"{base}/") as page:
            assert page.status == 200
            assert "read-only" in await page.text()

    run(config(), dsn, scenario)
    with pytest.raises(ConfigError, match="needs a password"):
        server.check_exposure(config(), "0.0.0.0")
    server.check_exposure(config(f"PASSWORD = {HASH}\n"), "0.0.0.0")  # with one it may


def test_a_password_in_clear_is_refused_in_the_configuration() -> None:
    with pytest.raises(ConfigError, match="not a password"):
        config("PASSWORD = hunter2\n")
