"""The event loop of Pepsi's servers: uvloop's, asyncio's where uvloop is missing.

uvloop (libuv under asyncio's API) runs the SMTP ingress's sockets with less CPU:
under `smtp-source -s 20`, one connection per message, the ingress took 16-18 %
less CPU and Pepsi relayed 10 % more messages a second (bench/mail.py). The
dispatcher runs on it too: its loop waits on many small statements (each
psycopg wait adds and removes a reader) and, with `[pepsi-amqp]`, on client
sockets; its own CPU fell by 15-20 % relaying mail and serving Celery
(docs/performance.md). It is a dependency on every platform it supports;
elsewhere asyncio's own loop runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on uvloop's loop when it is installed."""
    try:
        import uvloop  # noqa: PLC0415  # optional where it has no wheel
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
