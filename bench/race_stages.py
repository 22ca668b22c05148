"""What runs inside the consumers of bench/race.py: Pepsi's stages and the
peers' handlers and consumer loops (all no-ops).

A handler of a *stamp* message tells the benchmark when it started: it sends
`stamp <time.monotonic_ns()>` to the UNIX datagram socket named by
$RACE_SOCK (CLOCK_MONOTONIC is system-wide on Linux, so the benchmark can
subtract its own reading taken just before the publish call). A RabbitMQ
consumer also reports `done` after acking the burst's last message.

The peers' consumers are started by bench/race_peers.py (with bench/ on
PYTHONPATH; imported, not run as __main__, so procrastinate finds its app) as

    python -c 'import sys, race_stages; race_stages.main(sys.argv[1:])' KIND ARGS...

    KIND ARGS: pgqueuer DSN | procrastinate DSN CONCURRENCY | rabbitmq PORT QUEUE
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import time
from functools import cache
from typing import Any

from pepsi import Message, stage


@cache
def _socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)


def report(what: str) -> None:
    """Send one datagram to the benchmark ($RACE_SOCK), never blocking.

    A UNIX datagram queue holds only net.unix.max_dgram_qlen (10) datagrams:
    warm-up bursts overflow it while the benchmark is not reading, and a
    handler must not wait for that; the benchmark empties it before a sample.
    """
    with contextlib.suppress(BlockingIOError):
        _socket().sendto(what.encode(), socket.MSG_DONTWAIT, os.environ["RACE_SOCK"])


def send_stamp() -> None:
    report(f"stamp {time.monotonic_ns()}")


@stage()
def noop(msg: Message) -> None:
    """Pepsi: advance to NEXT, or finish at the last stage."""


@stage()
def stamp(msg: Message) -> None:
    """Pepsi: report when the stage started, then finish."""
    send_stamp()


def asyncpg_params(dsn: str) -> dict[str, Any]:
    """asyncpg.connect() keywords for a libpq key=value DSN (asyncpg wants URLs)."""
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    names = {"dbname": "database"}
    # passfile: where the embedded server's SCRAM secret is (asyncpg reads it too)
    known = {"host", "port", "user", "password", "passfile", "database"}
    out = {names.get(k, k): v for k, v in params.items()}
    return {k: v for k, v in out.items() if k in known}


async def pgqueuer_consumer(dsn: str) -> None:
    """One pgqueuer consumer process: default settings, entrypoints noop and stamp."""
    import asyncpg  # noqa: PLC0415
    from pgqueuer import PgQueuer  # noqa: PLC0415

    conn = await asyncpg.connect(**asyncpg_params(dsn))
    pgq = PgQueuer.from_asyncpg_connection(conn)

    @pgq.entrypoint("noop")
    async def _noop(job: Any) -> None:
        pass

    @pgq.entrypoint("stamp")
    async def _stamp(job: Any) -> None:
        send_stamp()

    await pgq.run()


def procrastinate_app(dsn: str) -> Any:
    """A procrastinate App with two async no-op tasks, `noop` and `stamp`."""
    from procrastinate import App, PsycopgConnector  # noqa: PLC0415

    app = App(connector=PsycopgConnector(conninfo=dsn))

    @app.task(name="noop")
    async def _noop(**kwargs: Any) -> None:
        pass

    @app.task(name="stamp")
    async def _stamp(**kwargs: Any) -> None:
        send_stamp()

    return app


async def procrastinate_consumer(dsn: str, concurrency: int) -> None:
    app = procrastinate_app(dsn)
    async with app.open_async():
        await app.run_worker_async(concurrency=concurrency)


def rabbitmq_consumer(port: int, queue: str) -> None:
    """pika, prefetch 100, one manual ack per message."""
    import pika  # noqa: PLC0415

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port))
    channel = conn.channel()
    channel.basic_qos(prefetch_count=100)

    def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
        if props.type == "stamp":
            send_stamp()
        ch.basic_ack(method.delivery_tag)
        if props.type == "last":
            report("done")

    channel.basic_consume(queue, on_message, auto_ack=False)
    channel.start_consuming()


def main(argv: list[str]) -> None:
    kind, *args = argv
    if kind == "pgqueuer":
        asyncio.run(pgqueuer_consumer(args[0]))
    elif kind == "procrastinate":
        asyncio.run(procrastinate_consumer(args[0], int(args[1])))
    elif kind == "rabbitmq":
        rabbitmq_consumer(int(args[0]), args[1])
    else:
        raise SystemExit(f"unknown consumer {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
