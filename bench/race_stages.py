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

    KIND ARGS: pgqueuer DSN SETTINGS | procrastinate DSN SETTINGS | rabbitmq PORT QUEUE SETTINGS

SETTINGS is a JSON object (see each consumer below); {} means the peer's defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import threading
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


def wait_go() -> None:
    """A gated consumer: block until the benchmark writes a line to our stdin."""
    if not sys.stdin.readline():
        raise SystemExit("stdin closed before go")


async def pgqueuer_consumer(dsn: str, settings: dict[str, Any]) -> None:
    """One pgqueuer consumer process: `managers` PgQueuer instances (a connection each, like
    pgqueuer's own benchmark tool's dequeue tasks), entrypoints noop and stamp.

    settings: batch (batch_size), managers, mode ("continuous" or "drain": a gated process
    reports `ready`, waits for go, drains once with mode=drain and exits), sync_commit
    (False: synchronous_commit off on its connections, as Pepsi's workers do; not a pgqueuer
    setting), max_tasks (max_concurrent_tasks).
    """
    import asyncpg  # noqa: PLC0415
    from pgqueuer import PgQueuer  # noqa: PLC0415
    from pgqueuer.types import QueueExecutionMode  # noqa: PLC0415

    server = {} if settings.get("sync_commit", True) else {"synchronous_commit": "off"}
    queuers = []
    for _ in range(settings.get("managers", 1)):
        conn = await asyncpg.connect(**asyncpg_params(dsn), server_settings=server)
        pgq = PgQueuer.from_asyncpg_connection(conn)

        @pgq.entrypoint("noop")
        async def _noop(job: Any) -> None:
            pass

        @pgq.entrypoint("stamp")
        async def _stamp(job: Any) -> None:
            send_stamp()

        queuers.append(pgq)
    mode = QueueExecutionMode(settings.get("mode", "continuous"))
    if mode is QueueExecutionMode.drain:
        report(f"ready {os.getpid()}")
        await asyncio.get_running_loop().run_in_executor(None, wait_go)
    await asyncio.gather(
        *(
            pgq.run(
                batch_size=settings.get("batch", 10),
                mode=mode,
                max_concurrent_tasks=settings.get("max_tasks"),
            )
            for pgq in queuers
        )
    )


def procrastinate_app(dsn: str, pool: int | None = None) -> Any:
    """A procrastinate App with two async no-op tasks, `noop` and `stamp`.

    pool: the connector's pool size (psycopg_pool's default is 4 connections)."""
    from procrastinate import App, PsycopgConnector  # noqa: PLC0415

    kwargs = {"min_size": pool, "max_size": pool} if pool else {}
    app = App(connector=PsycopgConnector(conninfo=dsn, **kwargs))

    @app.task(name="noop")
    async def _noop(**kwargs: Any) -> None:
        pass

    @app.task(name="stamp")
    async def _stamp(**kwargs: Any) -> None:
        send_stamp()

    return app


async def procrastinate_consumer(dsn: str, settings: dict[str, Any]) -> None:
    """settings: concurrency, pool, delete_jobs ("never", "successful", "always"),
    listen_notify, polling (fetch_job_polling_interval, seconds)."""
    app = procrastinate_app(dsn, settings.get("pool"))
    options: dict[str, Any] = {"concurrency": settings.get("concurrency", 10)}
    for key, option in (
        ("delete_jobs", "delete_jobs"),
        ("listen_notify", "listen_notify"),
        ("polling", "fetch_job_polling_interval"),
    ):
        if key in settings:
            options[option] = settings[key]
    async with app.open_async():
        await app.run_worker_async(**options)


def rabbitmq_consumer(port: int, queue: str, settings: dict[str, Any]) -> None:
    """pika, basic.qos(prefetch), manual acks: one per message, or with ack_every > 1 one
    multiple=True ack for every ack_every messages (RabbitMQ's advice for throughput).

    gated: consume only between a `go` and a `stop` line on stdin (reported back as
    `stopped` once basic.cancel is done): the queue fills with no consumer, then drains."""
    import pika  # noqa: PLC0415

    conn = pika.BlockingConnection(pika.ConnectionParameters("127.0.0.1", port, heartbeat=0))
    channel = conn.channel()
    channel.basic_qos(prefetch_count=settings.get("prefetch", 100))
    every = settings.get("ack_every", 1)
    unacked = 0

    def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
        nonlocal unacked
        if props.type == "stamp":
            send_stamp()
        unacked += 1
        if unacked >= every or props.type == "last":
            ch.basic_ack(method.delivery_tag, multiple=unacked > 1)
            unacked = 0
        if props.type == "last":
            report("done")

    if not settings.get("gated"):
        channel.basic_consume(queue, on_message, auto_ack=False)
        channel.start_consuming()
        return
    tags: list[str] = []

    def go() -> None:
        tags.append(channel.basic_consume(queue, on_message, auto_ack=False))

    def stop() -> None:
        nonlocal unacked
        while tags:
            channel.basic_cancel(tags.pop())
        if unacked:  # a batch of acks cut short by the stop
            channel.basic_ack(0, multiple=True)
            unacked = 0
        report("stopped")

    def commands() -> None:  # stdin is read on a thread: pika's loop keeps the main one
        for line in sys.stdin:
            conn.add_callback_threadsafe(go if line.strip() == "go" else stop)
        os._exit(0)  # the benchmark is gone

    threading.Thread(target=commands, daemon=True).start()
    while True:
        conn.process_data_events(time_limit=1)


def main(argv: list[str]) -> None:
    kind, *args = argv
    settings = json.loads(args[-1]) if args and args[-1].startswith("{") else {}
    if kind == "pgqueuer":
        if settings.get("uvloop", True):  # `pgq run` runs on uvloop when it is installed
            import uvloop  # noqa: PLC0415

            uvloop.run(pgqueuer_consumer(args[0], settings))
        else:
            asyncio.run(pgqueuer_consumer(args[0], settings))
    elif kind == "procrastinate":
        asyncio.run(procrastinate_consumer(args[0], settings))
    elif kind == "rabbitmq":
        rabbitmq_consumer(int(args[0]), args[1], settings)
    else:
        raise SystemExit(f"unknown consumer {kind!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
