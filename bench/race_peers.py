"""The contestants of bench/race.py, one small class each, and what they share:
scratch databases, the stamp socket, CPU accounting, a private RabbitMQ node.

Every contestant has the same interface; a workload it does not support
raises `Unsupported` (reported as a skipped cell with the reason):

    setup(workload)      start what the workload needs (consumers for drains)
    warm()               a few messages through warm consumers, before each rep
    drain(n) -> float    seconds from just before the first publish of n
                         messages (batches of 1 000) until the last is done
    latency() -> float   ms from just before one publish call to its handler start
    publish_one(n)       seconds for n confirmed 1 KB publishes, one per call
    publish_batch(n)     seconds for n confirmed 1 KB publishes, 1 000 per batch
    cpu_roles()          {role: CPU probe} besides `client` and `postgres`
    reset()              empty the queue after a publish rep
    close()
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import psycopg
from psycopg import conninfo, sql

from pepsi.config import Config, load_config
from pepsi.db import connect
from pepsi.publishing import AsyncPublisher, OutgoingMessage, Publisher

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BODY = b"x" * 1024
BATCH = 1000
DB_PREFIX = "race_"
CONSUMER = [sys.executable, "-c", "import sys, race_stages; race_stages.main(sys.argv[1:])"]
POLL = 0.01  # seconds between "anything left?" probes while draining
DRAINS = ("drain", "drain_preloaded")


class Unsupported(Exception):  # a skip with its reason, not an error
    """This contestant does not take part in this workload."""


# -- infrastructure -----------------------------------------------------------


def server_dsn() -> str:
    return connect.resolve(load_config(None)).dsn


def empty_database(name: str) -> str:
    """Drop and recreate database `name` on Pepsi's server (no schema); return its DSN."""
    admin = conninfo.make_conninfo(server_dsn(), dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        ident = sql.Identifier(name)
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(ident))
    return conninfo.make_conninfo(server_dsn(), dbname=name)


def db_name(workload: str, label: str) -> str:
    """A scratch database name for one contestant in one workload."""
    slug = "".join(ch if ch.isalnum() else "_" for ch in label.lower())
    return f"{DB_PREFIX}{workload}_{slug}"[:63]


def drop_database(name: str) -> None:
    admin = conninfo.make_conninfo(server_dsn(), dbname="postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        ident = sql.Identifier(name)
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class StampSocket:
    """The UNIX datagram socket consumers report to ($RACE_SOCK)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))

    def clear(self) -> None:
        self.sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                self.sock.recv(256)
        self.sock.setblocking(True)

    def wait(self, kind: str, timeout: float, after: int = 0) -> int:
        """The value of the next `kind` report not below `after` (0 for `done`).

        TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                what, _, value = self.sock.recv(256).decode().partition(" ")
            except TimeoutError:
                break
            if what == kind and int(value or 0) >= after:
                return int(value or 0)
        raise TimeoutError(f"no {kind!r} report in {timeout:.0f} s")

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


@dataclass
class Shared:
    """What every contestant may use: a temp dir, the stamp socket, the broker."""

    tmp: Path
    stamps: StampSocket
    rabbit_server: Path | None = None  # rabbitmq-server, if installed
    rabbit: RabbitBroker | None = None  # its node, started by the first contestant needing it
    rabbit_error: str = ""

    def broker(self) -> RabbitBroker:
        """The private RabbitMQ node, started on first use; Unsupported if it cannot be."""
        if self.rabbit is None and not self.rabbit_error:
            if self.rabbit_server is None:
                self.rabbit_error = "rabbitmq-server not installed"
            else:
                try:
                    self.rabbit = RabbitBroker(self.rabbit_server, self)
                except Exception as exc:  # noqa: BLE001
                    self.rabbit_error = f"rabbitmq-server failed to start: {exc!r}"
        if self.rabbit is None:
            raise Unsupported(self.rabbit_error)
        return self.rabbit

    def env(self) -> dict[str, str]:
        path = os.pathsep.join([str(HERE), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
        return {**os.environ, "RACE_SOCK": str(self.stamps.path), "PYTHONPATH": path}

    def spawn(
        self,
        name: str,
        argv: list[str],
        extra_env: dict[str, str] | None = None,
        *,
        gated: bool = False,
    ) -> Any:
        """Start a consumer process (gated: with a pipe on its stdin for go/stop lines)."""
        path = self.tmp / f"{name}.log"
        log = path.open("ab")
        proc = subprocess.Popen(
            argv,
            env={**self.env(), **(extra_env or {})},
            stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
        )
        proc.log_path = path  # type: ignore[attr-defined]  # for error messages
        return proc


def log_tail(proc: Any, lines: int = 3) -> str:
    """The last lines a consumer process wrote (its log goes with the temp dir)."""
    path: Path | None = getattr(proc, "log_path", None)
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").strip().splitlines()
    return " | ".join(line.strip()[:300] for line in text[-lines:])


def stop(proc: Any, timeout: float = 30) -> None:
    """Terminate a process we started (its own process group)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


# -- CPU accounting -----------------------------------------------------------


def _times(p: psutil.Process, children: bool) -> float:
    try:
        t = p.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0
    own = t.user + t.system
    return own + t.children_user + t.children_system if children else own


class CpuProbe:
    """Cumulative CPU seconds of a process: `own` only, its `tree` or `tree-own`.

    A tree is the root's own and reaped children's time plus every live
    descendant's own and reaped children's time: a child that exits moves its
    time from the live sum into its parent's children_* and nothing is lost
    or counted twice (Linux adds a reaped child's time, including what it
    reaped itself, to the parent's cutime/cstime).
    """

    def __init__(self, pids: Iterable[int], mode: str = "tree") -> None:
        self.roots = [psutil.Process(pid) for pid in pids]
        self.mode = mode

    def __call__(self) -> float:
        total = 0.0
        for root in self.roots:
            own = _times(root, children=False)
            if self.mode == "own":
                total += own
                continue
            tree = _times(root, children=True)
            with contextlib.suppress(psutil.NoSuchProcess):
                tree += sum(_times(d, children=True) for d in root.children(recursive=True))
            total += tree - own if self.mode == "tree-own" else tree
        return total


def postmaster_pid(dsn: str) -> int | None:
    """The PostgreSQL server's postmaster, from postmaster.pid in its data directory."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SHOW data_directory").fetchone()
        text = (Path(row[0]) / "postmaster.pid").read_text() if row else ""
        return int(text.split()[0])
    except (OSError, psycopg.Error, ValueError, IndexError):
        return None


# -- RabbitMQ -----------------------------------------------------------------

RABBIT_DIRS = ("/usr/lib/rabbitmq/bin", "/usr/sbin")


def find_rabbitmq() -> Path | None:
    """rabbitmq-server, preferring the unwrapped script (the /usr/sbin wrapper su's)."""
    for where in RABBIT_DIRS:
        path = Path(where) / "rabbitmq-server"
        if path.exists():
            return path
    found = shutil.which("rabbitmq-server")
    return Path(found) if found else None


class RabbitBroker:
    """A private RabbitMQ node: own data/log dirs, free ports, stopped at the end.

    Scheduler busy-waiting is off (`+sbwt none`), as RabbitMQ's runtime
    tuning guide advises on shared hosts, so an idle node does not spin.
    """

    def __init__(self, server: Path, shared: Shared) -> None:
        self.server = server
        self.port = free_port()
        self.node = f"race{os.getpid()}@localhost"
        base = shared.tmp / "rabbitmq"
        base.mkdir()
        (base / "enabled_plugins").write_text("[].\n")
        self.env = {
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "+sbwt none +sbwtdcpu none +sbwtdio none",
        }
        print(f"starting a private RabbitMQ node ({server})", file=sys.stderr, flush=True)
        self.proc = shared.spawn("rabbitmq", [str(server)], self.env)
        try:
            self._wait_ready(90)
        except BaseException:
            stop(self.proc)
            raise

    def _wait_ready(self, timeout: float) -> None:
        import pika  # noqa: PLC0415

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("rabbitmq-server exited while starting")
            try:
                pika.BlockingConnection(self.params()).close()
                return
            except pika.exceptions.AMQPConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def params(self) -> Any:
        import pika  # noqa: PLC0415

        return pika.ConnectionParameters("127.0.0.1", self.port, heartbeat=0)

    def declare(self, queue: str, queue_type: str = "quorum") -> None:
        import pika  # noqa: PLC0415

        conn = pika.BlockingConnection(self.params())
        ch = conn.channel()
        ch.queue_declare(queue, durable=True, arguments={"x-queue-type": queue_type})
        ch.queue_purge(queue)
        conn.close()

    def close(self) -> None:
        ctl = self.server.parent / "rabbitmqctl"
        if ctl.exists() and self.proc.poll() is None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run(
                    [str(ctl), "-n", self.node, "stop"],
                    env={**os.environ, **self.env},
                    capture_output=True,
                    timeout=60,
                    check=False,
                )
        stop(self.proc)


class WindowedPublisher:
    """pika publisher with confirms and up to `window` unconfirmed messages."""

    def __init__(self, params: Any, queue: str) -> None:
        import pika  # noqa: PLC0415

        self.queue = queue
        self.pika = pika
        self.channel: Any = None
        self.next_tag = 0  # the channel's delivery tags: 1, 2, ... in publish order
        self.conn = pika.SelectConnection(
            params,
            on_open_callback=self._opened,
            on_open_error_callback=self._failed,
            on_close_callback=lambda _conn, _reason: self.conn.ioloop.stop(),
        )
        self.error: Exception | None = None
        self.conn.ioloop.start()  # until the channel is in confirm mode
        if self.error:
            raise self.error

    def _failed(self, _conn: Any, error: Exception) -> None:
        self.error = error
        self.conn.ioloop.stop()

    def _opened(self, conn: Any) -> None:
        conn.channel(on_open_callback=self._channel)

    def _channel(self, channel: Any) -> None:
        self.channel = channel
        channel.confirm_delivery(self._ack, callback=lambda _frame: self.conn.ioloop.stop())

    def publish(self, n: int, body: bytes, window: int, last_type: str | None = None) -> None:
        """Publish n messages; return once every one is confirmed."""
        self.n, self.body, self.window, self.last_type = n, body, window, last_type
        self.sent = 0
        self.unconfirmed: set[int] = set()
        self.nacked = 0
        self._fill()
        self.conn.ioloop.start()
        if self.nacked:
            raise RuntimeError(f"RabbitMQ refused {self.nacked} messages")

    def _fill(self) -> None:
        plain = self.pika.BasicProperties(delivery_mode=2)
        while self.sent < self.n and len(self.unconfirmed) < self.window:
            self.sent += 1
            props = plain
            if self.sent == self.n and self.last_type:
                props = self.pika.BasicProperties(delivery_mode=2, type=self.last_type)
            self.channel.basic_publish("", self.queue, self.body, props)
            self.next_tag += 1
            self.unconfirmed.add(self.next_tag)

    def _ack(self, frame: Any) -> None:
        method = frame.method
        if method.multiple:
            done = {t for t in self.unconfirmed if t <= method.delivery_tag}
        else:
            done = {method.delivery_tag} & self.unconfirmed
        self.unconfirmed -= done
        if isinstance(method, self.pika.spec.Basic.Nack):
            self.nacked += len(done)
        if self.sent >= self.n and not self.unconfirmed:
            self.conn.ioloop.stop()
        else:
            self._fill()

    def close(self) -> None:
        if self.conn.is_open:
            self.conn.close()
            self.conn.ioloop.start()  # until the close completes


# -- helpers ------------------------------------------------------------------


def wait_empty(
    db: psycopg.Connection[Any], probe: str, timeout: float, alive: Callable[[], bool]
) -> None:
    """Poll `probe` (a query returning whether work is left) until false."""
    deadline = time.monotonic() + timeout
    while True:
        row = db.execute(probe).fetchone()
        if not (row and row[0]):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not drained within {timeout:.0f} s")
        if not alive():
            raise RuntimeError("a consumer process died")  # see Contestant.died()
        time.sleep(POLL)


def drain_timeout(n: int) -> float:
    return 30 + n / 50


def chunks(items: list[Any], size: int = BATCH) -> Iterator[list[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


class Loop:
    """A private event loop for async clients driven from synchronous code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.loop.close()


# -- contestants --------------------------------------------------------------


@dataclass
class Contestant:
    """Base: everything unsupported; subclasses fill in what they run."""

    shared: Shared
    label: str = ""
    procs: list[Any] = field(default_factory=list)
    dbname: str | None = None  # its scratch database, dropped after the workload
    t0: float = 0.0  # when a preloaded drain's clock started

    def setup(self, workload: str) -> None:
        raise Unsupported("not run")

    def warm(self) -> None:
        pass

    def drain(self, n: int) -> float:
        raise Unsupported("no drain")

    def preload(self, n: int) -> None:
        """Enqueue n messages no consumer sees before one commit; set t0 just after it."""
        raise Unsupported("no preloaded drain")

    def drain_preloaded(self, n: int) -> float:
        """Seconds from t0 (the preload's commit, or go) until the last message is done."""
        self.wait(n)
        return time.perf_counter() - self.t0

    def wait(self, n: int) -> None:
        raise Unsupported("no drain")

    def latency(self) -> float:
        raise Unsupported("no latency")

    def publish_one(self, n: int) -> float:
        raise Unsupported("no single publish")

    def publish_batch(self, n: int) -> float:
        raise Unsupported("no batch publish")

    def cpu_roles(self) -> dict[str, CpuProbe]:
        return {}

    def reset(self) -> None:
        pass

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def died(self) -> str:
        """What the first dead consumer process said last, for the report."""
        for p in self.procs:
            if p.poll() is not None:
                return f"exit {p.returncode}: {log_tail(p)}"
        return ""

    def close(self) -> None:
        for p in self.procs:
            stop(p)
        self.procs.clear()


WARM_ROUNDS = 20  # rounds, at most, to start every worker of Pepsi's pools
WARM_MESSAGES = 500  # a round's messages at least; more when a stage holds more in flight


class Pepsi(Contestant):
    """Pepsi: a dispatcher (`python -m pepsi dispatch serve`) from a pepsi.conf."""

    def __init__(
        self,
        shared: Shared,
        label: str,
        conf: str,
        *,
        first: str = "s1",
        senders: int = 0,
        async_pipeline: bool = False,
    ) -> None:
        super().__init__(shared, label)
        self.conf_text = conf
        self.first = first
        self.senders = senders
        self.async_pipeline = async_pipeline
        self.publisher: Publisher | None = None
        self.db: psycopg.Connection[Any] | None = None

    @staticmethod
    def config_text(fair: bool | None = None, stages: int = 1, handler: str = "noop") -> str:
        """Default configuration: only HANDLER (and NEXT), plus FAIR_SCHEDULING if given."""
        text = ""
        if fair is not None:
            text += f"[pepsi-dispatch]\nFAIR_SCHEDULING = {'yes' if fair else 'no'}\n"
        for i in range(1, stages + 1):
            text += f"[stage-s{i}]\nHANDLER = race_stages:{handler}\n"
            if i < stages:
                text += f"NEXT = s{i + 1}\n"
        return text

    def setup(self, workload: str) -> None:
        from common import scratch_database  # noqa: PLC0415

        self.dbname = db_name(workload, self.label)
        self.dsn = scratch_database(self.dbname)
        self.conf = self.shared.tmp / f"{self.dbname}.conf"
        self.conf.write_text(self.conf_text)
        self.config: Config = load_config(self.conf)
        self.publisher = Publisher.connect(self.config, self.dsn)
        self.db = psycopg.connect(self.dsn, autocommit=True)
        if workload in {*DRAINS, "drain3", "latency", "fairness", "sustained"}:
            argv = [sys.executable, "-m", "pepsi", "-c", str(self.conf), "dispatch", "serve"]
            self.procs.append(
                self.shared.spawn(f"dispatch-{self.dbname}", argv, {"PEPSI_DSN": self.dsn})
            )

    def messages(self, n: int, body: bytes | None = None) -> list[OutgoingMessage]:
        if self.senders:
            return [
                OutgoingMessage(self.first, body, origin_user=f"u{i % self.senders}")
                for i in range(n)
            ]
        return [OutgoingMessage(self.first, body)] * n

    def pending(self) -> int:
        assert self.db is not None
        row = self.db.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
        return int(row[0]) if row else 0

    def wait(self, n: int) -> None:
        assert self.db is not None
        probe = "SELECT EXISTS (SELECT 1 FROM pepsi.workqueue)"
        wait_empty(self.db, probe, drain_timeout(n), self.alive)

    def warm(self) -> None:
        """Publish and drain rounds until every stage's pool has all its workers
        (PARALLELISM each), as the peers' consumers are all running before the clock.
        A pool grows as its claims outrun it: 200 messages once started two of a
        stage's four, and the other two (0.33 s of CPU each) started on the clock. A
        round is more than a stage's workers hold at once (PARALLELISM × QUEUE_LIMIT),
        or the first workers would take it all and the last never start."""
        if not self.procs:
            return
        assert self.publisher is not None
        stages = self.config.stages.values()
        want = sum(stage.parallelism for stage in stages)
        size = max(WARM_MESSAGES, max(stage.capacity for stage in stages) + 1)
        dispatcher = psutil.Process(self.procs[0].pid)
        self.shared.stamps.clear()
        for _ in range(WARM_ROUNDS):
            self.publisher.publish_many(self.messages(size))
            self.wait(size)
            workers = [c for c in dispatcher.children() if "worker" in c.cmdline()]
            if len(workers) >= want:
                break
        self.shared.stamps.clear()

    def drain(self, n: int) -> float:
        assert self.publisher is not None
        batches = list(chunks(self.messages(n)))
        start = time.perf_counter()
        for batch in batches:
            self.publisher.publish_many(batch)
        self.wait(n)
        return time.perf_counter() - start

    def preload(self, n: int) -> None:
        assert self.publisher is not None
        self.publisher.publish_many(self.messages(n))  # one transaction
        self.t0 = time.perf_counter()

    def latency(self) -> float:
        assert self.publisher is not None
        t0 = time.monotonic_ns()
        self.publisher.publish(self.first)
        return (self.shared.stamps.wait("stamp", 10, t0) - t0) / 1e6

    def publish_one(self, n: int) -> float:
        assert self.publisher is not None
        pub = self.publisher
        start = time.perf_counter()
        for _ in range(n):
            pub.publish(self.first, BODY)
        return time.perf_counter() - start

    def publish_batch(self, n: int) -> float:
        if self.async_pipeline:
            return asyncio.run(self._pipelined(n))
        assert self.publisher is not None
        batches = list(chunks(self.messages(n, BODY)))
        start = time.perf_counter()
        for batch in batches:
            self.publisher.publish_many(batch)
        return time.perf_counter() - start

    async def _pipelined(self, n: int) -> float:
        """The async Pipeline with its defaults (1 000 outstanding, batches of 500, 2 conns)."""
        publisher = await AsyncPublisher.connect(self.config, self.dsn)
        msg = OutgoingMessage(self.first, BODY)
        async with publisher:
            start = time.perf_counter()
            async with publisher.pipeline() as pipe:
                for _ in range(n):
                    await pipe.submit(msg)
                await pipe.flush()
            return time.perf_counter() - start

    def cpu_roles(self) -> dict[str, CpuProbe]:
        if not self.procs:
            return {}
        pid = self.procs[0].pid
        return {"dispatcher": CpuProbe([pid], "own"), "workers": CpuProbe([pid], "tree-own")}

    def reset(self) -> None:
        if self.db is not None:
            self.db.execute("TRUNCATE pepsi.workqueue, pepsi.workqueue_body CASCADE")

    def close(self) -> None:
        super().close()
        if self.publisher is not None:
            self.publisher.close()
        if self.db is not None:
            self.db.close()


class RawSql(Contestant):
    """The ceilings: plain psycopg on a plain table.

    drain: "hop by primary key", one `UPDATE hop SET stage = 'done' WHERE id = $1`
    per message and per commit (synchronous_commit off, like Pepsi's workers'
    outcomes), on `connections` connections; the N rows are inserted before the
    clock starts. publish: INSERT of 1 KB bytea rows, synchronous_commit on.
    """

    def __init__(self, shared: Shared, connections: int = 1) -> None:
        super().__init__(shared, f"raw SQL ×{connections}")
        self.connections = connections
        self.hoppers: list[psycopg.Connection[Any]] = []

    def setup(self, workload: str) -> None:
        self.dbname = db_name(workload, self.label)
        self.dsn = empty_database(self.dbname)
        self.db = psycopg.connect(self.dsn, autocommit=True)
        self.db.execute("CREATE TABLE hop (id bigint PRIMARY KEY, stage text NOT NULL)")
        self.db.execute("CREATE TABLE raw (id bigserial PRIMARY KEY, body bytea)")
        self.db.execute("SET synchronous_commit = on")

    def preload(self, n: int) -> None:
        self.db.execute("TRUNCATE hop")
        self.db.execute("INSERT INTO hop SELECT g, 's1' FROM generate_series(1, %s) g", (n,))
        self.db.execute("VACUUM ANALYZE hop")
        if not self.hoppers:  # kept open: a closed backend's CPU could escape the probe
            for _ in range(self.connections):
                conn = psycopg.connect(self.dsn, autocommit=True)
                conn.execute("SET synchronous_commit = off")
                self.hoppers.append(conn)

    def drain_preloaded(self, n: int) -> float:
        def hop(conn: psycopg.Connection[Any], ids: range) -> None:
            for i in ids:
                conn.execute("UPDATE hop SET stage = 'done' WHERE id = %b", (i,), prepare=True)

        k = self.connections
        threads = [
            threading.Thread(target=hop, args=(c, range(j + 1, n + 1, k)))
            for j, c in enumerate(self.hoppers)
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - start

    def drain(self, n: int) -> float:
        self.preload(n)  # the rows are there before the clock in both drains
        return self.drain_preloaded(n)

    def publish_one(self, n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            self.db.execute("INSERT INTO raw (body) VALUES (%b)", (BODY,), prepare=True)
        return time.perf_counter() - start

    def publish_batch(self, n: int) -> float:
        start = time.perf_counter()
        for batch in chunks([BODY] * n):
            self.db.execute("INSERT INTO raw (body) SELECT b FROM unnest(%b::bytea[]) b", (batch,))
        return time.perf_counter() - start

    def reset(self) -> None:
        self.db.execute("TRUNCATE raw")

    def close(self) -> None:
        for conn in self.hoppers:
            conn.close()
        if hasattr(self, "db"):
            self.db.close()
