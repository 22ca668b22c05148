"""The console's aiohttp application: access control, CSRF, rendering, the login.

Pages live in `pepsi.web.pages` (one module each, with `setup(app)`); they read
through `Console.db` (a small pool of synchronous connections, used from a
thread so that `pepsi.admin` code runs as it does for `pepsi queue`) and render
with `Console.render`. Every request passes `guard`: a page needs access
(`security.access`), a POST a CSRF token and the console's own origin, and a
repair (`Console.require_repair`) a login and no READ_ONLY.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import jinja2
from aiohttp import web
from psycopg_pool import ConnectionPool

from pepsi.amqp.auth.passwords import verify
from pepsi.config import Config
from pepsi.web import security, tokens

log = logging.getLogger("pepsi.web")

HERE = Path(__file__).parent
POOL_SIZE = 4  # connections the console reads and repairs with
T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Console:
    """What every page needs: the configuration, the database, access, rendering."""

    config: Config
    dsn: str
    pool: ConnectionPool[Any]
    sessions: security.Sessions
    templates: jinja2.Environment
    dispatcher: Any = None  # the dispatcher serving this console, when it does
    token: str | None = None  # without PASSWORD: what a session is exchanged for
    listen_host: str = "127.0.0.1"  # the Host check's own name (security.host_allowed)
    throttle: security.LoginThrottle = field(
        default_factory=lambda: security.LoginThrottle(time.monotonic)
    )
    # scrypt on a thread of its own, never the loop's default executor (the dispatcher's,
    # when it serves the console): a flood of logins cannot slow AMQP, claims or reloads
    hashing: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="pepsi-web-auth")
    )

    @property
    def read_only(self) -> bool:
        return self.config.web.read_only or self.config.web.password is None

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(conn, *args, **kwargs)` with a pooled connection, in a thread."""

        def call() -> T:
            with self.pool.connection() as conn:
                return fn(conn, *args, **kwargs)

        return await asyncio.to_thread(call)

    def render(self, request: web.Request, template: str, **context: Any) -> web.Response:
        allowed = request[ACCESS]
        session = request.get(SESSION)
        page = self.templates.get_template(template).render(
            request=request,
            can_repair=allowed.can_repair,
            user=allowed.user,
            read_only=self.read_only,
            login_enabled=self.config.web.password is not None,
            csrf=session.csrf if session else "",
            csrf_field=security.CSRF_FIELD,
            **context,
        )
        return web.Response(text=page, content_type="text/html")

    def require_repair(self, request: web.Request) -> str:
        """The user doing a repair; 403 when this request may not repair."""
        allowed = request[ACCESS]
        if not allowed.can_repair:
            reason = "read-only console" if self.read_only else "log in to repair"
            raise web.HTTPForbidden(text=f"repairs refused: {reason}")
        return allowed.user or "?"


CONSOLE = web.AppKey("console", Console)
SESSION: web.RequestKey[security.Session | None] = web.RequestKey("session")
ACCESS = web.RequestKey("access", security.Access)


def console_of(request: web.Request) -> Console:
    return request.app[CONSOLE]


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    console = request.app[CONSOLE]
    public_url = console.config.web.public_url
    if not security.host_allowed(request.host, console.listen_host, public_url):
        log.warning("web: request for host %r from %s refused", request.host, request.remote)
        raise web.HTTPMisdirectedRequest(text="this console does not answer to that name")
    session = console.sessions.read(request.cookies.get(security.COOKIE))
    request[SESSION] = session
    allowed = security.access(
        password_set=console.config.web.password is not None,
        read_only=console.config.web.read_only,
        session=session,
        peer=request.remote,
    )
    request[ACCESS] = allowed
    from_here = allowed.allowed or allowed.needs_login  # without a password: loopback
    if tokens.QUERY in request.query and console.config.web.password is None and from_here:
        return _exchange_token(console, request)
    public = request.path in ("/login",) or request.path.startswith("/static/")
    if not public and not allowed.allowed:
        if allowed.needs_login:
            if request.method == "GET":
                raise web.HTTPSeeOther(f"/login?next={request.path_qs}")
            raise web.HTTPUnauthorized(text="log in first")
        raise web.HTTPForbidden(text="this console serves this machine only (no PASSWORD set)")
    if request.method == "POST":
        if not security.same_origin(
            request.headers.get("Origin"),
            request.headers.get("Referer"),
            request.host,
            request.scheme,
            public_url,
        ):
            log.warning("web: cross-site POST to %s from %s refused", request.path, request.remote)
            raise web.HTTPForbidden(text="cross-site request refused")
        if request.path != "/login":
            if session is None:  # no login, no form token: nothing a POST may change
                raise web.HTTPForbidden(
                    text="read-only console: set [pepsi-web] PASSWORD and log in to repair"
                )
            form = await request.post()
            submitted = form.get(security.CSRF_FIELD)
            if not security.csrf_ok(session, submitted if isinstance(submitted, str) else None):
                raise web.HTTPForbidden(text="missing or stale form token: reload the page")
    response = await handler(request)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    response.headers.setdefault("X-Frame-Options", "DENY")
    response.headers.setdefault("Referrer-Policy", "same-origin")
    response.headers.setdefault(
        "Content-Security-Policy",
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'",
    )
    return response


def _exchange_token(console: Console, request: web.Request) -> web.StreamResponse:
    """`?token=`: a session for the right token, and the same page without it (so that it
    stays out of the history and of any Referer); 401 for a wrong one."""
    if not security.token_ok(console.token, request.query.get(tokens.QUERY)):
        log.warning("web: wrong console token from %s", request.remote)
        return _login_form(console, request, request.path, "wrong or stale token", 401)
    query = {k: v for k, v in request.query.items() if k != tokens.QUERY}
    target = request.rel_url.with_query(query) if query else request.rel_url.with_query(None)
    log.info("web: token login from %s", request.remote)
    return _logged_in(console, request, str(target), "local")


def _login_form(
    console: Console, request: web.Request, target: str, error: str | None, status: int = 200
) -> web.Response:
    request[ACCESS] = security.Access(False, True, False, None)
    response = console.render(
        request,
        "login.html",
        next=target,
        error=error,
        with_token=console.config.web.password is None,
    )
    response.set_status(status)
    return response


def _logged_in(console: Console, request: web.Request, target: str, user: str) -> web.Response:
    """A new session's cookie, and on to `target`."""
    _, cookie = console.sessions.new(user)
    response = web.Response(status=303, headers={"Location": target})
    response.set_cookie(
        security.COOKIE,
        cookie,
        max_age=int(console.config.web.session_ttl),
        httponly=True,
        samesite="Strict",
        # behind a TLS proxy the request came in plain: PUBLIC_URL says the browser's scheme
        secure=request.secure or (console.config.web.public_url or "").startswith("https:"),
        path="/",
    )
    return response


async def login_page(request: web.Request) -> web.StreamResponse:
    target = security.local_path(request.query.get("next"))
    return _login_form(console_of(request), request, target, None)


async def login(request: web.Request) -> web.StreamResponse:
    console = console_of(request)
    stored = console.config.web.password
    form = await request.post()
    target = security.local_path(str(form.get("next") or "/"))  # never an open redirect
    wait = console.throttle.wait(request.remote)
    if wait > 0:  # refused before any hashing: a flood costs nothing
        response = _login_form(
            console, request, target, f"too many failed logins: try again in {wait:.0f} s", 429
        )
        response.headers["Retry-After"] = str(max(1, round(wait)))
        return response
    if stored is None:  # the token, pasted
        if not security.token_ok(console.token, form.get(tokens.QUERY)):
            console.throttle.failed(request.remote)
            log.warning("web: wrong console token from %s", request.remote)
            return _login_form(console, request, target, "wrong or stale token", 401)
        console.throttle.succeeded(request.remote)
        log.info("web: token login from %s", request.remote)
        return _logged_in(console, request, target, "local")
    password = form.get("password")
    loop = asyncio.get_running_loop()
    ok = isinstance(password, str) and await loop.run_in_executor(
        console.hashing, verify, password, stored
    )
    if not ok:
        console.throttle.failed(request.remote)
        log.warning("web: failed login from %s", request.remote)
        return _login_form(console, request, target, "wrong password", 401)
    console.throttle.succeeded(request.remote)
    log.info("web: login from %s", request.remote)
    return _logged_in(console, request, target, "admin")


async def logout(request: web.Request) -> web.StreamResponse:
    session = request.get(SESSION)
    if session is not None:  # ended on the server too: a copy of the cookie is worth nothing
        console_of(request).sessions.revoke(session)
    response = web.HTTPSeeOther("/login")
    response.del_cookie(security.COOKIE, path="/")
    raise response


def make_app(
    config: Config,
    dsn: str,
    *,
    dispatcher: Any = None,
    token: str | None = None,
    listen_host: str = "127.0.0.1",
) -> web.Application:
    """The console; its pool opens with the app and closes with it."""
    pool: ConnectionPool[Any] = ConnectionPool(
        dsn,
        min_size=1,
        max_size=POOL_SIZE,
        open=False,
        kwargs={"application_name": "pepsi-web", "autocommit": True},
    )
    templates = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    console = Console(
        config,
        dsn,
        pool,
        security.Sessions(config.web.session_ttl, time.time),
        templates,
        dispatcher,
        token,
        listen_host,
    )
    app = web.Application(middlewares=[guard], client_max_size=1024 * 1024)
    app[CONSOLE] = console
    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
    app.router.add_static("/static/", HERE / "static")
    from pepsi.web.pages import register  # noqa: PLC0415  # pages import this module

    register(app)

    async def lifecycle(app: web.Application) -> Any:
        await asyncio.to_thread(pool.open, wait=False)
        yield
        await asyncio.to_thread(pool.close)
        console.hashing.shutdown(wait=False)

    app.cleanup_ctx.append(lifecycle)
    return app
