"""The console refuses what it must (issue 17): an unauthenticated request, a cross-site
POST, a POST without its form token, a wrong password, and a console exposed beyond
this machine without a password, and without one, anybody without the token. A real
server on an ephemeral port, the test database."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import stat
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from yarl import URL

from pepsi.amqp.auth.passwords import hash_password
from pepsi.config import Config
from pepsi.config.ini import parse_ini
from pepsi.config.parse import parse_config
from pepsi.errors import ConfigError
from pepsi.web import server
from pepsi.web.app import CONSOLE
from pepsi.web.security import LoginThrottle

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
        RUNNING[:] = [running]
        try:
            jar = aiohttp.CookieJar(unsafe=True)  # keep cookies for an IP address
            async with aiohttp.ClientSession(cookie_jar=jar) as http:
                return await scenario(http, running.url.rstrip("/"))
        finally:
            await running.stop()

    return asyncio.run(main())


RUNNING: list[server.Running] = []  # the console `run` serves, for a scenario to look at


def throttle() -> LoginThrottle:
    return RUNNING[0].runner.app[CONSOLE].throttle


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
        # issue 34, finding 6: the next try waits (1 s, then 2, 4 … up to a minute),
        # refused before any hashing
        form["password"] = PASSWORD
        async with http.post(f"{base}/login", data=form, headers={"Origin": base}) as slowed:
            assert slowed.status == 429
            assert slowed.headers["Retry-After"] == "1"
            assert "too many failed logins" in await slowed.text()
        throttle().succeeded("127.0.0.1")  # as if the second had passed
        for hostile in ("/\t/evil.example/x", "/\n/evil.example", "//evil.example", "/\\evil"):
            async with http.post(
                f"{base}/login", data={**form, "next": hostile}, headers={"Origin": base},
                allow_redirects=False,
            ) as redirected:  # fmt: skip
                assert redirected.status == 303
                assert redirected.headers["Location"] == "/"  # never another site
            http.cookie_jar.clear()
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
        # logout ends the session on the server: a copy of the cookie is worth nothing
        copied = http.cookie_jar.filter_cookies(URL(base))["pepsi_session"].value
        page = await (await http.get(f"{base}/stages")).text()
        token = re.search(r'name="csrf" value="([^"]+)"', page)
        assert token is not None
        async with http.post(
            f"{base}/logout", data={"csrf": token.group(1)}, headers={"Origin": base},
            allow_redirects=False,
        ) as out:  # fmt: skip
            assert out.status == 303
        async with (
            aiohttp.ClientSession() as replay,
            replay.get(
                f"{base}/stages",
                headers={"Cookie": f"pepsi_session={copied}"},
                allow_redirects=False,
            ) as again,
        ):
            assert again.status == 303  # to the login page

    run(cfg, dsn, scenario)


def test_without_a_password_nobody_gets_in_without_the_token(dsn: str) -> None:
    async def main() -> None:
        running = await server.start(config(), dsn, ("127.0.0.1", 0))
        base = running.url.rstrip("/")
        assert running.token is not None
        assert running.link == f"{base}/?token={running.token}"
        try:
            jar = aiohttp.CookieJar(unsafe=True)
            async with aiohttp.ClientSession(cookie_jar=jar) as http:
                for path in ("/", "/stages", "/message/1", "/overview/live"):
                    async with http.get(base + path, allow_redirects=False) as anonymous:
                        assert anonymous.status == 303, path  # from loopback too
                        assert anonymous.headers["Location"].startswith("/login")
                async with http.post(f"{base}/logout", headers={"Origin": base}) as post:
                    assert post.status == 401
                async with http.get(f"{base}/login") as login:
                    assert 'name="token"' in await login.text()  # a token, not a password
                async with http.get(f"{base}/stages?token=wrong", allow_redirects=False) as bad:
                    assert bad.status == 401
                    assert "pepsi_session" not in bad.cookies
                form = {"token": "wrong", "next": "/"}
                async with http.post(f"{base}/login", data=form, headers={"Origin": base}) as bad:
                    assert bad.status == 401
                async with http.get(base + "/", allow_redirects=False) as still:
                    assert still.status == 303
                # the link: a session, and the page again without the token in its address
                link = f"{base}/stages?token={running.token}&x=1"
                async with http.get(link, allow_redirects=False) as exchanged:
                    assert exchanged.status == 303
                    assert exchanged.headers["Location"] == "/stages?x=1"
                    assert exchanged.cookies["pepsi_session"]["httponly"]
                async with http.get(f"{base}/") as page:
                    assert page.status == 200
                    text = await page.text()
                    assert "read-only" in text
                    assert running.token not in text
                    assert page.headers["Referrer-Policy"] == "same-origin"
            # the wrong token above slowed this client down (1 s): as if that had passed
            running.runner.app[CONSOLE].throttle.succeeded("127.0.0.1")
            async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
                form = {"token": running.token, "next": "/stages"}  # pasted into the form
                async with http.post(
                    f"{base}/login", data=form, headers={"Origin": base}, allow_redirects=False
                ) as pasted:
                    assert pasted.status == 303
                    assert pasted.headers["Location"] == "/stages"
                async with http.get(f"{base}/stages") as page:
                    assert page.status == 200
        finally:
            await running.stop()

    asyncio.run(main())
    with pytest.raises(ConfigError, match="needs a password"):
        server.check_exposure(config(), "0.0.0.0")
    server.check_exposure(config(f"PASSWORD = {HASH}\n"), "0.0.0.0")  # with one it may


def test_pepsi_web_prints_its_link_and_pepsi_web_url_prints_it_again(
    dsn: str, tmp_path: Path
) -> None:
    conf = tmp_path / "pepsi.conf"
    conf.write_text("[stage-a]\nHANDLER = tests.stages:noop\n")
    env = {**os.environ, "PEPSI_DSN": dsn, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    pepsi = [sys.executable, "-m", "pepsi", "-c", str(conf)]
    web = subprocess.Popen(
        [*pepsi, "web", "--listen", "127.0.0.1:0"], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert web.stdout is not None
        printed = web.stdout.readline().strip()
        assert printed.startswith("Pepsi console at http://127.0.0.1:")
        link = printed.rsplit(" ", 1)[1]
        assert "?token=" in link
        again = subprocess.run(
            [*pepsi, "web", "url"], env=env, capture_output=True, text=True, check=True
        )
        assert again.stdout.split() == [link, "(pepsi", "web,", "pid", f"{web.pid})"]
        folder = tmp_path / "xdg" / "pepsi" / "web"
        (token_file,) = folder.iterdir()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        with urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar())).open(
            link, timeout=10
        ) as page:
            assert page.status == 200  # after the exchange for a session
            assert page.url == link.split("?")[0]
    finally:
        web.send_signal(signal.SIGINT)
        web.wait(30)
        if web.stdout is not None:
            web.stdout.close()
    assert list(folder.iterdir()) == []  # its file went with it
    gone = subprocess.run(
        [*pepsi, "web", "url"], env=env, capture_output=True, text=True, check=False
    )
    assert gone.returncode == 1
    assert gone.stderr.count("\n") == 1
    assert "no console" in gone.stderr


def test_a_password_in_clear_is_refused_in_the_configuration() -> None:
    with pytest.raises(ConfigError, match="not a password"):
        config("PASSWORD = hunter2\n")


def test_a_foreign_host_is_misdirected_and_a_public_url_is_the_consoles(dsn: str) -> None:
    """Issue 34, findings 5 and 8: any Host was answered (DNS rebinding); behind a TLS
    proxy, the https Origin was refused and the cookie never Secure."""
    cfg = config(f"PASSWORD = {HASH}\nPUBLIC_URL = https://pepsi.example.org\n")

    async def scenario(http: aiohttp.ClientSession, base: str) -> None:
        async with http.get(
            f"{base}/login", headers={"Host": "evil.example"}, allow_redirects=False
        ) as rebound:
            assert rebound.status == 421
        async with http.get(f"{base}/login", headers={"Host": "pepsi.example.org"}) as page:
            assert page.status == 200  # through the proxy, Host kept
        form = {"password": PASSWORD, "next": "/"}
        async with http.post(
            f"{base}/login", data=form, allow_redirects=False,
            headers={"Host": "pepsi.example.org", "Origin": "https://pepsi.example.org"},
        ) as login:  # fmt: skip
            assert login.status == 303
            cookie = login.cookies["pepsi_session"]
            assert cookie["secure"]

    run(cfg, dsn, scenario)
    with pytest.raises(ConfigError, match="PUBLIC_URL"):
        config("PUBLIC_URL = pepsi.example.org/console\n")
