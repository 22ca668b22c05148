"""Connections to the embedded server (a Unix socket) can send a large statement at once."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from pepsi.db.connect import SEND_BUFFER_BYTES, connect, connect_async


def _send_buffer(fd: int) -> int:
    with socket.socket(fileno=fd) as sock:
        try:
            return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        finally:
            sock.detach()  # the connection's own descriptor: not closed here


def _default() -> int:
    return int(Path("/proc/sys/net/core/wmem_default").read_text())


def test_both_connects_widen_the_send_buffer(dsn: str) -> None:
    with connect(dsn) as conn:
        size = _send_buffer(conn.fileno())
        assert size > _default()
        assert size >= min(SEND_BUFFER_BYTES, 2 * _default())
        # a statement bigger than the default buffer goes through as before
        big = "x" * (3 * _default())
        assert conn.execute("SELECT length(%s)", [big]).fetchone() == (len(big),)

    async def check() -> int:
        aconn = await connect_async(dsn)
        async with aconn:
            return _send_buffer(aconn.fileno())

    assert asyncio.run(check()) == size
