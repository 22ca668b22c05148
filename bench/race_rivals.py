"""The peers of bench/race.py as contestants: pgqueuer, procrastinate and RabbitMQ, each
with its settings (bench/peer_sweep.py races the settings against each other; race.py
runs the best found).

A settings dict goes to the consumer processes as JSON (bench/race_stages.py reads it);
a label names every setting that differs from the peer's default, so a table row says
what was run.
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar

import psycopg
from race_peers import (
    BATCH,
    BODY,
    CONSUMER,
    DRAINS,
    Contestant,
    CpuProbe,
    Loop,
    Shared,
    Unsupported,
    WindowedPublisher,
    chunks,
    db_name,
    drain_timeout,
    empty_database,
    wait_empty,
)


def feed(proc: Any, line: str) -> None:
    """Write one command line to a gated consumer's stdin."""
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()


class PgQueuer(Contestant):
    """pgqueuer through asyncpg: `consumers` processes, each running `settings` (see
    race_stages.pgqueuer_consumer); `durability` and `autovac` (`pgq autovac`'s table
    settings) are applied when the schema is installed.

    mode "drain" is pgqueuer's own benchmark tool's drain strategy: the processes start
    (imports, connections) after the jobs are enqueued and wait; the clock runs from go
    until every process has drained the queue and exited. Only the preloaded drain.
    """

    DEFAULTS: ClassVar[dict[str, Any]] = {
        "batch": 10,
        "managers": 1,
        "uvloop": True,  # `pgq run` uses uvloop when installed (it comes with pgqueuer)
        "mode": "continuous",
        "sync_commit": True,
        "max_tasks": None,
    }

    def __init__(
        self,
        shared: Shared,
        consumers: int = 1,
        *,
        durability: str = "durable",
        autovac: bool = False,
        **settings: Any,
    ) -> None:
        self.settings = {**self.DEFAULTS, **settings}
        self.consumers, self.durability, self.autovac = consumers, durability, autovac
        super().__init__(shared, self.describe())

    def describe(self) -> str:
        if not self.consumers:
            return "pgqueuer"
        s = self.settings
        text = f"pgqueuer ×{self.consumers} b={s['batch']}"
        text += f" m={s['managers']}" if s["managers"] != 1 else ""
        text += f" max_tasks={s['max_tasks']}" if s["max_tasks"] else ""
        text += " asyncio" if not s["uvloop"] else ""
        text += f" {self.durability}" if self.durability != "durable" else ""
        text += " autovac" if self.autovac else ""
        text += " drain-mode" if s["mode"] == "drain" else ""
        text += " sync_commit=off †" if not s["sync_commit"] else ""
        return text

    def setup(self, workload: str) -> None:
        import asyncpg  # noqa: PLC0415
        from pgqueuer import Queries  # noqa: PLC0415
        from pgqueuer.adapters.persistence.qb import QueryBuilderEnvironment  # noqa: PLC0415
        from pgqueuer.domain.settings import DBSettings, Durability  # noqa: PLC0415
        from race_stages import asyncpg_params  # noqa: PLC0415

        if self.settings["mode"] == "drain" and workload != "drain_preloaded":
            raise Unsupported("drain mode: only the preloaded drain")
        self.dbname = db_name(workload, self.label)
        self.dsn = empty_database(self.dbname)
        self.loop = Loop()
        self.conn = self.loop.run(asyncpg.connect(**asyncpg_params(self.dsn)))
        env = QueryBuilderEnvironment(settings=DBSettings(durability=Durability(self.durability)))
        self.queries = Queries(Queries.from_asyncpg_connection(self.conn).driver, qbe=env)
        self.loop.run(self.queries.install())
        if self.autovac:
            self.loop.run(self.queries.optimize_autovacuum())
        self.db = psycopg.connect(self.dsn, autocommit=True)
        self.workload = workload
        if workload in {*DRAINS, "latency"} and self.settings["mode"] != "drain":
            for i in range(self.consumers):
                self.procs.append(self.shared.spawn(f"pgqueuer-{workload}-{i}", self.argv()))

    def argv(self) -> list[str]:
        return [*CONSUMER, "pgqueuer", self.dsn, json.dumps(self.settings)]

    def _enqueue_many(self, entrypoint: str, payload: bytes | None, n: int) -> None:
        self.loop.run(self.queries.enqueue([entrypoint] * n, [payload] * n, [0] * n))

    def wait(self, n: int) -> None:
        wait_empty(self.db, "SELECT EXISTS (SELECT 1 FROM pgqueuer)", drain_timeout(n), self.alive)

    def warm(self) -> None:
        if self.procs:
            self._enqueue_many("noop", None, 200)
            self.wait(200)

    def drain(self, n: int) -> float:
        start = time.perf_counter()
        for batch in chunks([None] * n):
            self._enqueue_many("noop", None, len(batch))
        self.wait(n)
        return time.perf_counter() - start

    def preload(self, n: int) -> None:
        self._enqueue_many("noop", None, n)  # one statement
        if self.settings["mode"] == "drain":  # start the drainers, ready but held back
            self.shared.stamps.clear()
            for i in range(self.consumers):
                name = f"pgqueuer-drain-{i}"
                self.procs.append(self.shared.spawn(name, self.argv(), gated=True))
            for _ in self.procs:
                self.shared.stamps.wait("ready", 60)
            for p in self.procs:
                feed(p, "go")
        self.t0 = time.perf_counter()

    def drain_preloaded(self, n: int) -> float:
        if self.settings["mode"] != "drain":
            return super().drain_preloaded(n)
        deadline = time.monotonic() + drain_timeout(n)
        for p in self.procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        seconds = time.perf_counter() - self.t0
        failed = [p.returncode for p in self.procs if p.returncode]
        self.procs.clear()
        if failed or self.db.execute("SELECT EXISTS (SELECT 1 FROM pgqueuer)").fetchone()[0]:
            raise RuntimeError(f"drain-mode consumers left jobs behind (exit codes {failed})")
        return seconds

    def latency(self) -> float:
        t0 = time.monotonic_ns()
        self.loop.run(self.queries.enqueue("stamp", None))
        return (self.shared.stamps.wait("stamp", 10, t0) - t0) / 1e6

    def publish_one(self, n: int) -> float:
        async def run() -> None:
            for _ in range(n):
                await self.queries.enqueue("noop", BODY)

        start = time.perf_counter()
        self.loop.run(run())
        return time.perf_counter() - start

    def publish_batch(self, n: int) -> float:
        start = time.perf_counter()
        for batch in chunks([BODY] * n):
            self._enqueue_many("noop", BODY, len(batch))
        return time.perf_counter() - start

    def cpu_roles(self) -> dict[str, CpuProbe]:
        if not self.procs or self.settings["mode"] == "drain":
            return {}  # drain-mode processes exit within the run: their CPU is not probed
        return {"consumers": CpuProbe([p.pid for p in self.procs])}

    def reset(self) -> None:
        self.db.execute("TRUNCATE pgqueuer")

    def close(self) -> None:
        super().close()
        if hasattr(self, "conn"):  # set up (a sweep sets it up again for its next rep)
            self.loop.run(self.conn.close())
            self.loop.close()
            self.db.close()
            del self.conn


class Procrastinate(Contestant):
    """procrastinate: `processes` worker processes running async no-op tasks with
    `settings` (see race_stages.procrastinate_consumer)."""

    JOBS_LEFT = "SELECT EXISTS (SELECT 1 FROM procrastinate_jobs WHERE status IN ('todo', 'doing'))"

    def __init__(self, shared: Shared, concurrency: int = 10, processes: int = 1,
                 **settings: Any) -> None:  # fmt: skip
        self.settings = {"concurrency": concurrency, **settings}
        self.processes = processes
        text = f"procrastinate c={concurrency}"
        text += f" ×{processes}" if processes != 1 else ""
        text += "".join(f" {k}={v}" for k, v in settings.items())
        super().__init__(shared, text)

    def setup(self, workload: str) -> None:
        from race_stages import procrastinate_app  # noqa: PLC0415

        self.dbname = db_name(workload, self.label)
        self.dsn = empty_database(self.dbname)
        self.loop = Loop()
        self.app = procrastinate_app(self.dsn)
        self.loop.run(self.app.open_async())
        self.loop.run(self.app.schema_manager.apply_schema_async())
        self.noop = self.app.tasks["noop"]
        self.stamp = self.app.tasks["stamp"]
        self.db = psycopg.connect(self.dsn, autocommit=True)
        self.body = BODY.decode()
        if workload in {*DRAINS, "latency"}:
            argv = [*CONSUMER, "procrastinate", self.dsn, json.dumps(self.settings)]
            for i in range(self.processes):
                self.procs.append(self.shared.spawn(f"procrastinate-{workload}-{i}", argv))

    def wait(self, n: int) -> None:
        wait_empty(self.db, self.JOBS_LEFT, drain_timeout(n), self.alive)

    def warm(self) -> None:
        if self.procs:
            self.loop.run(self.noop.batch_defer_async(*[{}] * 200))
            self.wait(200)

    def drain(self, n: int) -> float:
        start = time.perf_counter()
        for batch in chunks([{}] * n):
            self.loop.run(self.noop.batch_defer_async(*batch))
        self.wait(n)
        return time.perf_counter() - start

    def preload(self, n: int) -> None:
        self.loop.run(self.noop.batch_defer_async(*[{}] * n))  # one statement
        self.t0 = time.perf_counter()

    def latency(self) -> float:
        t0 = time.monotonic_ns()
        self.loop.run(self.stamp.defer_async())
        return (self.shared.stamps.wait("stamp", 10, t0) - t0) / 1e6

    def publish_one(self, n: int) -> float:
        async def run() -> None:
            for _ in range(n):
                await self.noop.defer_async(body=self.body)

        start = time.perf_counter()
        self.loop.run(run())
        return time.perf_counter() - start

    def publish_batch(self, n: int) -> float:
        start = time.perf_counter()
        for batch in chunks([{"body": self.body}] * n):
            self.loop.run(self.noop.batch_defer_async(*batch))
        return time.perf_counter() - start

    def cpu_roles(self) -> dict[str, CpuProbe]:
        return {"consumers": CpuProbe([p.pid for p in self.procs])} if self.procs else {}

    def reset(self) -> None:
        self.db.execute("TRUNCATE procrastinate_jobs CASCADE")

    def close(self) -> None:
        super().close()
        if hasattr(self, "app"):
            self.loop.run(self.app.close_async())
            self.loop.close()
            self.db.close()
            del self.app


class RabbitMQ(Contestant):
    """RabbitMQ through pika: `consumers` consumer processes (basic.qos `prefetch`, manual
    acks, one per message or one multiple=True per `ack_every`), a publisher with confirms
    and at most `window` unconfirmed; a quorum queue, or a durable classic one.

    The preloaded drain holds the consumers back (see race_stages.rabbitmq_consumer): the
    messages are published and confirmed first, the clock starts at go. The last message
    is typed `last`, and its consumer reports when it is acked: with several consumers the
    others may still hold up to `prefetch` messages each (a few ms of work; what they
    hold when told to stop goes back to the queue, which is purged before the next rep).
    """

    def __init__(
        self,
        shared: Shared,
        consumers: int = 1,
        *,
        prefetch: int = 100,
        ack_every: int = 1,
        window: int = BATCH,
        queue_type: str = "quorum",
    ) -> None:
        self.consumers, self.window, self.queue_type = consumers, window, queue_type
        self.settings: dict[str, Any] = {"prefetch": prefetch, "ack_every": ack_every}
        text = f"RabbitMQ {queue_type}"
        if (consumers, prefetch, ack_every, window) != (1, 100, 1, BATCH):
            text += f" ×{consumers} prefetch={prefetch}"
            text += f" ack_every={ack_every}" if ack_every != 1 else ""
            text += f" window={window}" if window != BATCH else ""
        super().__init__(shared, text)

    def setup(self, workload: str) -> None:
        import pika  # noqa: PLC0415

        self.broker = self.shared.broker()
        self.pika = pika
        self.queue = f"race_{workload}_{id(self)}"
        self.broker.declare(self.queue, self.queue_type)
        self.conn = pika.BlockingConnection(self.broker.params())
        self.channel = self.conn.channel()
        self.channel.confirm_delivery()
        self.gated = workload == "drain_preloaded"
        if workload in {*DRAINS, "latency"}:
            settings = json.dumps({**self.settings, "gated": self.gated})
            argv = [*CONSUMER, "rabbitmq", str(self.broker.port), self.queue, settings]
            for i in range(self.consumers):
                name = f"rabbitmq-consumer-{workload}-{i}"
                self.procs.append(self.shared.spawn(name, argv, gated=self.gated))

    def _windowed(self, n: int, body: bytes, last: str | None = None) -> float:
        pub = WindowedPublisher(self.broker.params(), self.queue)
        try:
            start = time.perf_counter()
            pub.publish(n, body, self.window, last)
            if last and not self.gated:
                self.shared.stamps.wait("done", drain_timeout(n))
            return time.perf_counter() - start
        finally:
            pub.close()

    def _command(self, line: str) -> None:
        for p in self.procs:
            feed(p, line)

    def _stop(self) -> None:
        """Hold the gated consumers back again (each reports once it has cancelled)."""
        self.shared.stamps.clear()
        self._command("stop")
        for _ in self.procs:
            self.shared.stamps.wait("stopped", 30)

    def warm(self) -> None:
        if not self.procs:
            return
        self.shared.stamps.clear()
        if self.gated:
            self.channel.queue_purge(self.queue)
            self._command("go")
            self._windowed(200, b"", "last")
            self.shared.stamps.wait("done", 30)
            self._stop()
        else:
            self._windowed(200, b"", "last")

    def drain(self, n: int) -> float:
        self.shared.stamps.clear()
        return self._windowed(n, b"", "last")

    def preload(self, n: int) -> None:
        # what a stopped consumer had received but not yet handled went back to the queue
        self.channel.queue_purge(self.queue)
        self._windowed(n, b"", "last")  # every message confirmed, no consumer yet
        self.shared.stamps.clear()
        self._command("go")
        self.t0 = time.perf_counter()

    def drain_preloaded(self, n: int) -> float:
        self.shared.stamps.wait("done", drain_timeout(n))
        seconds = time.perf_counter() - self.t0
        self._stop()
        return seconds

    def latency(self) -> float:
        props = self.pika.BasicProperties(delivery_mode=2, type="stamp")
        t0 = time.monotonic_ns()
        self.channel.basic_publish("", self.queue, b"", props)
        return (self.shared.stamps.wait("stamp", 10, t0) - t0) / 1e6

    def publish_one(self, n: int) -> float:
        props = self.pika.BasicProperties(delivery_mode=2)
        start = time.perf_counter()
        for _ in range(n):
            self.channel.basic_publish("", self.queue, BODY, props)
        return time.perf_counter() - start

    def publish_batch(self, n: int) -> float:
        return self._windowed(n, BODY)

    def cpu_roles(self) -> dict[str, CpuProbe]:
        roles = {"broker": CpuProbe([self.broker.proc.pid])}
        if self.procs:
            roles["consumers"] = CpuProbe([p.pid for p in self.procs])
        return roles

    def reset(self) -> None:
        self.channel.queue_purge(self.queue)

    def close(self) -> None:
        super().close()
        if hasattr(self, "conn"):
            if self.conn.is_open:
                self.channel.queue_delete(self.queue)
                self.conn.close()
            del self.conn
