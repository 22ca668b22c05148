"""The console's stages, stage, message and repair pages on a real server and queue."""

from __future__ import annotations

import asyncio
import html
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import psycopg
import pytest
from psycopg import sql

from pepsi.admin import queue
from pepsi.amqp.auth.passwords import hash_password
from pepsi.config import Config
from pepsi.config.ini import parse_ini
from pepsi.config.parse import parse_config
from pepsi.db.queries import query
from pepsi.web.server import start

Conn = psycopg.Connection[Any]
HASH = hash_password("pw")
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def config(*, read_only: bool = False) -> Config:
    text = (
        "[stage-a]\nHANDLER = tests.stages:noop\nNEXT = b\n"
        "[stage-b]\nHANDLER = tests.stages:noop\n"
        f"[pepsi-web]\nPASSWORD = {HASH}\n" + ("READ_ONLY = yes\n" if read_only else "")
    )
    return parse_config(parse_ini(text, "test"))


@dataclass
class Web:
    session: aiohttp.ClientSession
    base: str

    @property
    def origin(self) -> dict[str, str]:
        return {"Origin": self.base}

    async def get(self, path: str) -> tuple[int, str]:
        async with self.session.get(self.base + path, allow_redirects=False) as r:
            return r.status, await r.text()

    async def post(
        self, path: str, data: dict[str, str], *, csrf: bool = True
    ) -> tuple[int, str, str]:
        """Status, text and Location of a POST with the console's origin (and token)."""
        form = dict(data)
        if csrf:
            _, page = await self.get("/stages")
            found = CSRF.search(page)
            assert found, "no csrf token on the page"
            form["csrf"] = found.group(1)
        async with self.session.post(
            self.base + path, data=form, headers=self.origin, allow_redirects=False
        ) as r:
            return r.status, await r.text(), r.headers.get("Location", "")


@asynccontextmanager
async def console(dsn: str, *, read_only: bool = False) -> AsyncIterator[Web]:
    running = await start(config(read_only=read_only), dsn, ("127.0.0.1", 0))
    base = running.url.rstrip("/")
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
            async with s.post(
                base + "/login",
                data={"password": "pw", "next": "/"},
                headers={"Origin": base},
                allow_redirects=False,
            ) as r:
                assert r.status == 303, await r.text()
            yield Web(s, base)
    finally:
        await running.stop()


def run(dsn: str, scenario: Callable[[Web], Awaitable[None]], **kw: Any) -> None:
    async def main() -> None:
        async with console(dsn, **kw) as web:
            await scenario(web)

    asyncio.run(main())


def insert(conn: Conn, rows: str, *args: Any) -> None:
    conn.execute(
        "INSERT INTO pepsi.workqueue (workqueue_id, stage, status, state, origin_user, arrived) "
        + rows,
        args,
    )


def ids_listed(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'<a href="/message/(\d+)">', page)]


def status_of(conn: Conn, message_id: int) -> str:
    row = conn.execute(
        "SELECT status::text FROM pepsi.workqueue WHERE workqueue_id = %s", (message_id,)
    ).fetchone()
    assert row is not None
    return str(row[0])


# -- the pages ------------------------------------------------------------------------------


def test_stages_list_counts_every_stage(dsn: str, conn: Conn) -> None:
    insert(
        conn,
        "VALUES (1, 'a', 'pending', '{}', 'alice', now()), (2, 'amqp:/:q', 'pending', '{}',"
        " 'bob', now()), (3, 'b', 'failed', '{\"failure_class\": \"crashed\"}', 'bob', now())",
    )

    async def scenario(web: Web) -> None:
        code, page = await web.get("/stages")
        assert code == 200
        for name in ("a", "b", "amqp:/:q"):
            assert f">{name}</a>" in page
        assert 'href="/stage/amqp:/:q"' in page
        assert "AMQP queue" in page
        assert "crashed" in page
        code, page = await web.get("/stage/amqp:/:q")
        assert code == 200
        assert "AMQP queue" in page
        assert ids_listed(page) == [2]
        code, page = await web.get("/stage/a")
        assert "workers are shown when the console runs in the dispatcher" in page
        assert "parallelism" in page  # the stage's options

    run(dsn, scenario)


def test_stage_pages_by_id(dsn: str, conn: Conn) -> None:
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status) SELECT 'a', 'pending'"
        " FROM generate_series(1, 120)"
    )
    conn.execute("INSERT INTO pepsi.workqueue (stage, status) VALUES ('b', 'pending')")

    async def scenario(web: Web) -> None:
        seen: list[int] = []
        path: str | None = "/stage/a?status=pending"
        pages = 0
        while path is not None:
            code, page = await web.get(path)
            assert code == 200, page
            seen += ids_listed(page)
            pages += 1
            found = re.search(r'href="([^"]+)" id="next-page"', page)
            path = html.unescape(found.group(1)) if found else None
            if path is not None:
                assert "after=" in path
                assert "status=pending" in path
        assert pages == 3
        assert seen == list(range(1, 121))
        code, page = await web.get("/stage/a?after=100")
        assert ids_listed(page) == list(range(101, 121))
        assert 'id="next-page"' not in page
        code, page = await web.get("/stage/a?after=x")
        assert code == 400

    run(dsn, scenario)


def test_stage_filters(dsn: str, conn: Conn) -> None:
    insert(
        conn,
        "VALUES (1, 'a', 'pending', '{}', 'alice', now() - interval '2 hours'),"
        " (2, 'a', 'pending', '{}', 'bob', now()),"
        " (3, 'a', 'failed', '{\"failure_class\": \"crashed\"}', 'bob', now()),"
        " (4, 'a', 'timeout', '{\"failure_class\": \"timed-out\"}', 'bob', now()),"
        " (5, 'a', 'paused', '{}', 'carol', now() - interval '3 hours')",
    )

    async def scenario(web: Web) -> None:
        async def listed(qs: str) -> list[int]:
            code, page = await web.get("/stage/a" + qs)
            assert code == 200, page
            return ids_listed(page)

        assert await listed("") == [1, 2, 3, 4, 5]
        assert await listed("?status=failed") == [3]
        assert await listed("?status=timeout") == [4]
        assert await listed("?status=paused") == [5]
        assert await listed("?sender=user:bob") == [2, 3, 4]
        assert await listed("?sender=user:bob&status=pending") == [2]
        assert await listed("?failure_class=crashed") == [3]
        assert await listed("?older=60") == [1, 5]
        assert await listed("?older=60&status=pending") == [1]
        code, page = await web.get("/stage/a?status=nonsense")
        assert code == 400
        assert "no status" in page
        code, _ = await web.get("/stage/a?older=-3")
        assert code == 400

    run(dsn, scenario)


def test_message_page_text_binary_and_missing(dsn: str, conn: Conn) -> None:
    text_body = conn.execute(
        "INSERT INTO pepsi.workqueue_body (header, body) VALUES ('Subject: hi\n\n', %s)"
        " RETURNING body_id",
        ("héllo <b>world</b>".encode(),),
    ).fetchone()
    binary_body = conn.execute(
        "INSERT INTO pepsi.workqueue_body (header, body) VALUES (NULL, %s) RETURNING body_id",
        (bytes([0xFF, 0x00, 0x41]) + b"x" * (70 * 1024),),
    ).fetchone()
    assert text_body
    assert binary_body
    conn.execute(
        "INSERT INTO pepsi.workqueue (workqueue_id, stage, status, timeout, state, body_id)"
        " VALUES (1, 'a', 'paused', now() + interval '1 hour',"
        ' \'{"strikes": 2, "last_error": "boom <x>", "failed_stage": "a"}\', %s),'
        " (2, 'b', 'failed', NULL, '{\"failure_class\": \"permanent\"}', %s)",
        (text_body[0], binary_body[0]),
    )

    async def scenario(web: Web) -> None:
        code, page = await web.get("/message/1")
        assert code == 200
        assert 'id="status" class="status-paused">paused<' in page
        assert "héllo &lt;b&gt;world&lt;/b&gt;" in page  # text, escaped
        assert "boom &lt;x&gt;" in page
        assert "Subject: hi" in page
        assert "stages ahead (configuration)" in page  # a -> b
        assert 'id="resume"' in page
        assert 'id="retry"' not in page
        assert "cut" not in page.split('id="body"')[1]
        code, page = await web.get("/message/2")
        assert code == 200
        body = page.split('id="body"')[1]
        assert "hex dump" in body
        assert "00000000  ff 00 41 78" in body
        assert "<strong>cut</strong>" in body
        assert "65536 bytes shown" in body
        assert 'id="retry"' in page
        code, page = await web.get("/message/999")
        assert code == 404
        assert "no message 999" in page
        code, _ = await web.get("/message/nonsense")
        assert code == 404

    run(dsn, scenario)


# -- repairs --------------------------------------------------------------------------------


def test_retry_by_preview_and_do(dsn: str, conn: Conn, caplog: pytest.LogCaptureFixture) -> None:
    insert(
        conn,
        'VALUES (7, \'b\', \'failed\', \'{"failed_stage": "a", "failure_class": "crashed",'
        " \"strikes\": 3}', 'bob', now())",
    )

    async def scenario(web: Web) -> None:
        form = {"action": "retry", "ids": "7", "back": "/message/7"}
        code, page, _ = await web.post("/repair/preview", form)
        assert code == 200, page
        assert 'data-count="1"' in page
        assert 'id="confirm"' in page
        assert status_of(conn, 7) == "failed"  # a preview changes nothing
        fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', page))
        assert fields["expected"] == "1"
        fields.pop("csrf")
        code, page, location = await web.post("/repair/do", fields)
        assert code == 303, page
        assert location.startswith("/message/7?done=retry")
        code, page = await web.get(location)
        assert 'id="status" class="status-pending">pending<' in page
        assert "retry: 1 message(s)" in page

    with caplog.at_level(logging.INFO, logger="pepsi.web"):
        run(dsn, scenario)
    assert status_of(conn, 7) == "pending"
    assert conn.execute("SELECT stage FROM pepsi.workqueue WHERE workqueue_id = 7").fetchone() == (
        "a",
    )
    logged = [r.getMessage() for r in caplog.records if r.name == "pepsi.web"]
    assert any("retry of 1 message(s) by admin from 127.0.0.1" in m for m in logged), logged


def test_bulk_by_filter_and_count_changed(dsn: str, conn: Conn) -> None:
    insert(
        conn,
        "VALUES (1, 'b', 'failed', '{\"failure_class\": \"crashed\"}', 'bob', now()),"
        " (2, 'b', 'failed', '{\"failure_class\": \"crashed\"}', 'alice', now()),"
        " (3, 'b', 'timeout', '{\"failure_class\": \"timed-out\"}', 'bob', now())",
    )

    async def scenario(web: Web) -> None:
        base = {"action": "retry", "stage": "b", "back": "/stage/b?status=failed"}
        # The filter: bob's failed rows only.
        narrowed = {**base, "scope": "filter", "status": "failed", "sender": "user:bob"}
        code, page, _ = await web.post("/repair/preview", narrowed)
        assert 'data-count="1"' in page
        # All of the stage: 3 rows; then one more fails before the confirmation.
        code, page, _ = await web.post("/repair/preview", {**base, "scope": "all"})
        assert 'data-count="3"' in page
        insert(conn, "VALUES (4, 'b', 'failed', '{}', 'carol', now())")
        code, page, _ = await web.post("/repair/do", {**base, "scope": "all", "expected": "3"})
        assert code == 409
        assert "changed since the preview (3 then, 4 now)" in page
        assert [status_of(conn, i) for i in (1, 2, 3, 4)] == ["failed"] * 2 + ["timeout", "failed"]
        # The filter, confirmed.
        code, _, location = await web.post("/repair/do", {**narrowed, "expected": "1"})
        assert code == 303
        assert location.startswith("/stage/b?status=failed&done=retry")
        # Errors are pages.
        code, page, _ = await web.post(
            "/repair/preview", {"action": "move", "ids": "2", "to": "nowhere"}
        )
        assert code == 400
        assert "no stage named" in page
        code, page, _ = await web.post("/repair/preview", {"action": "resume", "ids": "2"})
        assert code == 409
        assert "not in a state it applies to" in page
        code, page, _ = await web.post("/repair/preview", {"action": "explode", "ids": "2"})
        assert code == 409

    run(dsn, scenario)
    assert [status_of(conn, i) for i in (1, 2, 3, 4)] == ["pending", "failed", "timeout", "failed"]


def test_move_and_delete_single(dsn: str, conn: Conn) -> None:
    insert(
        conn, "VALUES (1, 'a', 'paused', '{}', 'bob', now()), (2, 'a', 'pending', '{}', 'x', now())"
    )

    async def scenario(web: Web) -> None:
        code, _, location = await web.post(
            "/repair/do",
            {"action": "move", "ids": "1", "to": "b", "expected": "1", "back": "/message/1"},
        )
        assert code == 303
        code, _, location = await web.post(
            "/repair/do", {"action": "delete", "ids": "2", "expected": "1", "back": "/stage/a"}
        )
        assert code == 303
        assert location.startswith("/stage/a?done=delete")

    run(dsn, scenario)
    assert conn.execute(
        "SELECT workqueue_id, stage, status::text FROM pepsi.workqueue"
    ).fetchall() == [(1, "b", "pending")]


def test_read_only_and_csrf_refuse(dsn: str, conn: Conn) -> None:
    insert(conn, "VALUES (7, 'b', 'failed', '{}', 'bob', now())")
    form = {"action": "retry", "ids": "7", "expected": "1", "back": "/message/7"}

    async def read_only(web: Web) -> None:
        code, page = await web.get("/message/7")
        assert code == 200
        assert 'id="retry"' not in page
        assert "/repair/preview" not in page
        code, text, _ = await web.post("/repair/preview", form)
        assert code == 403
        code, text, _ = await web.post("/repair/do", form)
        assert code == 403
        assert "read-only" in text

    async def no_token(web: Web) -> None:
        code, text, _ = await web.post("/repair/do", form, csrf=False)
        assert code == 403
        assert "token" in text
        code, text, _ = await web.post("/repair/preview", form, csrf=False)
        assert code == 403

    run(dsn, read_only, read_only=True)
    run(dsn, no_token)
    assert status_of(conn, 7) == "failed"


# -- the plans: keyset paging along the partial indexes --------------------------------------


def plan_of(conn: Conn, where: queue.MessageFilter, after: int) -> tuple[list[str], list[str]]:
    """The node types of a page's plan, and the indexes it reads."""
    name, params = queue.page_query(where, limit=51, after=after)
    with conn.transaction():  # as list_messages reads a page
        conn.execute(query("workqueue_page_in_order"))
        row = conn.execute(sql.SQL("EXPLAIN (FORMAT JSON) ") + query(name), params).fetchone()
    assert row is not None
    found = row[0]
    plan = nodes(dict((json.loads(found) if isinstance(found, str) else found)[0]["Plan"]))
    return [n["Node Type"] for n in plan], [n["Index Name"] for n in plan if "Index Name" in n]


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += nodes(child)
    return found


def test_paging_plans_use_the_partial_indexes(conn: Conn) -> None:
    """50 000 rows over ten stages: a stage's pending or failed rows page along their
    partial index from any id on, without a sort, whatever the plan (custom or generic)."""
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status, state, origin_user)"
        " SELECT 's' || (i % 10),"
        "        (CASE WHEN i % 7 = 0 THEN 'failed' WHEN i % 11 = 0 THEN 'timeout'"
        "              WHEN i % 13 = 0 THEN 'paused' ELSE 'pending' END)::pepsi.workqueue_status,"
        '        CASE WHEN i % 7 = 0 THEN \'{"failure_class": "crashed"}\'::jsonb'
        "             ELSE '{}'::jsonb END,"
        "        'u' || (i % 17)"
        " FROM generate_series(1, 50000) AS i"
    )
    conn.execute("ANALYZE pepsi.workqueue")
    plain = {
        "workqueue_pending_idx": queue.MessageFilter(stage="s1", status="pending"),
        "workqueue_failed_idx": queue.MessageFilter(stage="s3", status="failed"),
    }
    for index, where in plain.items():
        for after in (0, 20000, 49000):
            for _ in range(7):  # past psycopg's prepare threshold: generic plans too
                kinds, used = plan_of(conn, where, after=after)
                assert kinds == ["Limit", "Index Scan"], (where, after, kinds)
                assert used == [index], (where, after, used)
    # Narrowed further (failure class, age): still along the partial index from `after`
    # on, in its order.
    narrowed = {
        "workqueue_pending_idx": queue.MessageFilter(
            stage="s2", status="pending", failure_class="x", older_than=60
        ),
        "workqueue_failed_idx": queue.MessageFilter(
            stage="s4", status="timeout", failure_class="crashed"
        ),
    }
    for index, where in narrowed.items():
        for after in (0, 20000):
            kinds, used = plan_of(conn, where, after=after)
            assert kinds == ["Limit", "Index Scan"], (where, after, kinds)
            assert used == [index], (where, after, used)
    # And they page right.
    where = queue.MessageFilter(stage="s3", status="failed")
    first = queue.list_messages(conn, where, limit=10, after=0)
    second = queue.list_messages(conn, where, limit=10, after=first[-1].id)
    both = first + second
    assert all(m.status == "failed" and m.stage == "s3" for m in both)
    assert [m.id for m in both] == sorted({m.id for m in both})
    assert len(both) == 20
