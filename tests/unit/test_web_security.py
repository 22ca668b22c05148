"""The console's access rules, sessions and CSRF checks (pure), and its token's file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pepsi.web import security, tokens


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_session_cookie_round_trips_and_expires() -> None:
    clock = Clock()
    sessions = security.Sessions(60, clock, secret=b"k" * 32)
    session, cookie = sessions.new()
    assert sessions.read(cookie) == session
    clock.now += 61
    assert sessions.read(cookie) is None


def test_a_logged_out_session_is_no_session_even_with_its_cookie() -> None:
    """Issue 34, finding 7: after logout the old cookie still worked for SESSION_TTL."""
    clock = Clock()
    sessions = security.Sessions(60, clock, secret=b"k" * 32)
    session, cookie = sessions.new()
    other, other_cookie = sessions.new()
    sessions.revoke(session)
    assert sessions.read(cookie) is None
    assert sessions.read(other_cookie) == other  # only that one
    clock.now += 61
    sessions.revoke(other)  # revoking forgets the expired ones: the list stays short
    assert list(sessions._revoked) == [other.csrf]


@pytest.mark.parametrize(
    "cookie", [None, "", "x", "a.b.c", "eyJ9.AAAA", "e30.forged-signature-here"]
)
def test_malformed_or_forged_cookies_are_no_session(cookie: str | None) -> None:
    assert security.Sessions(60, Clock(), secret=b"k" * 32).read(cookie) is None


def test_a_cookie_signed_with_another_secret_is_refused() -> None:
    _, cookie = security.Sessions(60, Clock(), secret=b"a" * 32).new()
    assert security.Sessions(60, Clock(), secret=b"b" * 32).read(cookie) is None
    payload, signature = cookie.split(".")
    assert security.Sessions(60, Clock(), secret=b"a" * 32).read(payload + "x." + signature) is None


def test_csrf_needs_the_sessions_own_token() -> None:
    session, _ = security.Sessions(60, Clock()).new()
    assert security.csrf_ok(session, session.csrf)
    assert not security.csrf_ok(session, "guess")
    assert not security.csrf_ok(session, None)
    assert not security.csrf_ok(None, session.csrf)


@pytest.mark.parametrize(
    ("origin", "referer", "ok"),
    [
        ("http://127.0.0.1:8080", None, True),
        ("http://evil.example", None, False),
        ("null", "http://127.0.0.1:8080/stage/a", True),
        (None, "http://127.0.0.1:8080/x", True),
        (None, "http://127.0.0.1:8081/x", False),
        ("https://127.0.0.1:8080", None, False),  # another scheme is another origin
        (None, None, False),
    ],
)
def test_a_post_must_come_from_the_consoles_origin(
    origin: str | None, referer: str | None, ok: bool
) -> None:
    assert security.same_origin(origin, referer, "127.0.0.1:8080", "http") is ok


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("::ffff:127.0.0.1", True),
     ("10.0.0.1", False), ("192.0.2.7", False), (None, False), ("localhost", True)],
)  # fmt: skip
def test_loopback(host: str | None, loopback: bool) -> None:
    assert security.is_loopback(host) is loopback


def test_access_rules() -> None:
    session, _ = security.Sessions(60, Clock()).new("admin")
    with_password = security.access(password_set=True, read_only=False, session=None, peer="::1")
    assert (with_password.allowed, with_password.needs_login) == (False, True)
    logged_in = security.access(password_set=True, read_only=False, session=session, peer="x")
    assert (logged_in.allowed, logged_in.can_repair, logged_in.user) == (True, True, "admin")
    read_only = security.access(password_set=True, read_only=True, session=session, peer="x")
    assert (read_only.allowed, read_only.can_repair) == (True, False)
    # no password: nobody without the token's session, and then to look only
    anonymous = security.access(password_set=False, read_only=False, session=None, peer="::1")
    assert (anonymous.allowed, anonymous.needs_login) == (False, True)
    local = security.access(password_set=False, read_only=False, session=session, peer="::1")
    assert (local.allowed, local.can_repair) == (True, False)
    remote = security.access(password_set=False, read_only=False, session=session, peer="10.1.2.3")
    assert (remote.allowed, remote.needs_login) == (False, False)  # this machine only


def test_a_token_must_be_the_consoles_own() -> None:
    assert security.token_ok("abc", "abc")
    assert not security.token_ok("abc", "abd")
    assert not security.token_ok("abc", None)
    assert not security.token_ok(None, "abc")  # a console with a password has no token


def test_a_consoles_token_file_is_its_owners_and_goes_with_its_process(tmp_path: Path) -> None:
    folder = tmp_path / "web"
    mine = tokens.Console(os.getpid(), "http://127.0.0.1:8080/?token=t1", "pepsi web")
    path = tokens.publish(mine, 8080, folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid no process has now
    tokens.publish(tokens.Console(gone.pid, "http://127.0.0.1:9/?token=t2", "x"), 9, folder)
    assert tokens.running(folder) == [mine]
    assert [p.name for p in folder.iterdir()] == [path.name]  # the dead one's file went
    assert tokens.link("http://h:1/", "a/b") == "http://h:1/?token=a%2Fb"


@pytest.mark.parametrize(
    "target",
    [
        "//evil.example/x", "/\\evil.example", "/\t/evil.example/x", "/\n/evil.example",
        "/%09/evil.example", "/ /evil.example", "https://evil.example/", "evil.example",
        "/a\\b", "/a\x7fb", "", None, "\t/stages", "/\u2028/evil.example",
    ],
)  # fmt: skip
def test_a_redirect_target_is_a_same_site_path_or_the_default(target: str | None) -> None:
    """Issue 34, finding 4: `/login?next=/%09/evil.example/x` passed the `/` and `//`
    tests; the browser dropped the tab and went to //evil.example/x."""
    expected = "/%09/evil.example" if target == "/%09/evil.example" else "/"
    assert security.local_path(target) == expected  # percent-encoded: a path, harmless


@pytest.mark.parametrize("target", ["/", "/stages", "/stage/a?status=failed", "/message/12#x"])
def test_same_site_paths_go_through(target: str) -> None:
    assert security.local_path(target, "/stages") == target


def test_failed_logins_slow_their_client_down_and_a_success_forgets() -> None:
    """Issue 34, finding 6: 20 wrong passwords took 1.4 s, each hashed."""
    clock = Clock()
    throttle = security.LoginThrottle(clock)
    assert throttle.wait("10.0.0.1") == 0.0
    waits = []
    for _ in range(8):
        throttle.failed("10.0.0.1")
        waits.append(throttle.wait("10.0.0.1"))
        clock.now += waits[-1]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]  # up to a minute
    assert throttle.wait("10.0.0.2") == 0.0  # per client
    throttle.succeeded("10.0.0.1")
    assert throttle.wait("10.0.0.1") == 0.0
    throttle.failed("10.0.0.3")
    clock.now += security.LoginThrottle.FORGET_AFTER + 1
    throttle.failed("10.0.0.4")  # a quiet client's failures are forgotten on the way
    throttle.failed("10.0.0.3")
    assert throttle.wait("10.0.0.3") == 1.0


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("127.0.0.1:8080", True), ("[::1]:8080", True), ("192.0.2.7", True),
        ("localhost:8080", True), ("console.lan:8080", True), ("pepsi.example.org", True),
        ("evil.example:8080", False), ("127.0.0.1.evil.example", False), ("", False),
        (None, False),
    ],
)  # fmt: skip
def test_the_host_must_name_this_console(host: str | None, allowed: bool) -> None:
    """Issue 34, finding 5: a page of another site rebound to 127.0.0.1 (DNS rebinding)
    comes with that site's name in Host: 421."""
    public = "https://pepsi.example.org"
    assert security.host_allowed(host, "console.lan", public) is allowed


def test_behind_a_tls_proxy_its_public_origin_is_the_consoles() -> None:
    """Issue 34, finding 8: an Origin https://… behind the proxy docs/web.md recommends
    was refused (403)."""
    public = "https://pepsi.example.org"
    origin = "https://pepsi.example.org"
    assert security.same_origin(origin, None, "pepsi.example.org", "http", public)
    assert not security.same_origin(origin, None, "pepsi.example.org", "http")
    assert not security.same_origin("https://evil.example", None, "x", "http", public)
