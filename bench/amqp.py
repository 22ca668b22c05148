"""AMQP: Pepsi's listener next to RabbitMQ, cell by cell (issues 16 and 36).

    .venv/bin/python bench/amqp.py [--messages 20000] [--window 1000] [--reps 3]
                                   [--celery-tasks 2000] [--no-celery]
                                   [--latency-samples 200] [--json FILE]

Cells, each for 1 KB and 10 KB bodies:

- publish: persistent messages through pika's asynchronous SelectConnection with
  publisher confirms, at most --window unconfirmed (acks with multiple=True free the
  window), to one queue through the default exchange; from the first publish to the last
  confirm. Every consume cell below starts with such a publish, so a rep has two of them;
- consume, prefetch 1 and prefetch 100: one consumer takes the N messages back with
  basic.qos(prefetch) and one basic.ack per message; from consume-ok to the last delivery.

And idle latency (--latency-samples, 0 for none): one persistent 100-byte publish with
a confirm every 20 ms, from just before basic_publish to the callback of a consumer
(prefetch 1, its own connection, in a thread), median, p99 and max ms; the first 10 of
each run are not counted.

And a Celery cell: a Celery app (bench/amqp_celery.py) with `broker_url = amqp://...`, the
`rpc://` result backend and task_acks_late=True, its worker a subprocess (`celery worker
--pool prefork --concurrency 2`, started in a temp dir of its own, stopped with SIGTERM,
Celery's warm shutdown); --celery-tasks `add.delay(i, i)` calls, then `.get()` of every
result: round-trip tasks/s from the first delay to the last result.

Brokers:

- Pepsi: `pepsi dispatch serve` with its default configuration plus `[pepsi-amqp] LISTEN`
  (the dispatcher's claim feeds AMQP consumers), in a process of its own, on a scratch
  database of the embedded (or $PEPSI_DSN) server, dropped at the end; a classic queue
  (every Pepsi queue is a durable stage);
- RabbitMQ, when `rabbitmq-server` is installed and starts: a node of its own in a
  temporary directory on a free port (nothing is installed; skipped when absent), a
  quorum queue and a durable classic queue (both confirm once the message is on disk);
  Celery declares its own queues (classic, durable).

Reps alternate between the brokers; each phase starts once the brokers' own processes
are idle (the other broker's background work, a quorum queue's compaction, done). Each
cell is the median over the reps (min..max shown); CPU: the broker's processes per 1 000
messages (Pepsi: the dispatcher, and the whole PostgreSQL server, which other users of
the server share), and this client's. Prints one JSON document, a markdown table and
one summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import queue as queue_module
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
from common import scratch_database
from pika.adapters.select_connection import SelectConnection
from race_peers import CpuProbe, drop_database, find_rabbitmq, postmaster_pid, server_dsn

HERE = Path(__file__).resolve().parent
BODIES = {"1 KB": 1024, "10 KB": 10 * 1024}
PREFETCHES = (1, 100)
USER, PASSWORD = "bench", "bench-secret"
LATENCY_WARM = 10  # the first publishes of a latency run, not counted


@dataclass
class Broker:
    """One broker under test: how to reach it, and the processes that are it."""

    name: str
    params: pika.ConnectionParameters
    url: str  # for Celery
    pids: list[int]  # its processes (trees): CPU and idleness
    postgres: int | None = None  # Pepsi: the postmaster (the whole server's CPU)
    queues: dict[str, dict[str, Any]] = field(default_factory=dict)  # label: arguments

    def cpu(self) -> dict[str, CpuProbe]:
        probes = {"broker": CpuProbe(self.pids), "client": CpuProbe([os.getpid()], "own")}
        if self.postgres:
            probes["postgres"] = CpuProbe([self.postgres])
        return probes


def quiet(brokers: list[Broker], limit: float = 0.05, timeout: float = 20.0) -> None:
    """Wait until the brokers' own processes are idle (under `limit` cores over 0.5 s): the
    other broker's background work must not land in the next phase's numbers. Other users
    of the machine are not waited for: race.py's `other load` is how to see them."""
    probe = CpuProbe([pid for b in brokers for pid in b.pids])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        before = probe()
        time.sleep(0.5)
        if probe() - before < limit * 0.5:
            return


def measured(broker: Broker, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """run(), plus CPU ms per 1 000 messages of the broker's processes and of the client."""
    probes = broker.cpu()
    before = {role: probe() for role, probe in probes.items()}
    result = run()
    result["cpu_ms_per_1k"] = {
        role: round((probe() - before[role]) / result["messages"] * 1e6, 1)
        for role, probe in probes.items()
    }
    return result


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_port(port: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return True
        time.sleep(0.2)
    return False


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    """SIGTERM to the process group we started; SIGKILL if it does not go."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


# -- the clients ---------------------------------------------------------------------------


class WindowedPublisher:
    """Publish `count` messages, at most `window` unconfirmed; time first publish to last ack."""

    def __init__(self, params: pika.ConnectionParameters, queue: str, arguments: dict[str, Any],
                 count: int, window: int, *, body: bytes) -> None:  # fmt: skip
        self.params, self.queue, self.arguments = params, queue, arguments
        self.count, self.window, self.body = count, window, body
        self.sent = self.confirmed = self.nacked = 0
        self.outstanding: set[int] = set()
        self.started = self.finished = 0.0
        self.error: str | None = None
        self.props = pika.BasicProperties(delivery_mode=2, content_type="application/octet-stream")

    def run(self) -> dict[str, Any]:
        self.connection = SelectConnection(
            self.params,
            on_open_callback=self._opened,
            on_open_error_callback=self._failed,
            on_close_callback=self._closed,
        )
        self.connection.ioloop.start()
        if self.error:
            raise RuntimeError(self.error)
        seconds = self.finished - self.started
        return {"messages": self.count, "seconds": round(seconds, 3),
                "per_s": round(self.count / seconds, 1), "nacked": self.nacked}  # fmt: skip

    def _failed(self, _: Any, error: Any) -> None:
        self.error = f"connection failed: {error}"
        self.connection.ioloop.stop()

    def _closed(self, _: Any, reason: Any) -> None:
        self.connection.ioloop.stop()

    def _close_timeout(self) -> None:
        print(f"{type(self).__name__}: no Close-Ok in 30 s", file=sys.stderr, flush=True)
        self.connection.ioloop.stop()

    def _opened(self, connection: Any) -> None:
        connection.channel(on_open_callback=self._channel)

    def _channel(self, channel: Any) -> None:
        self.channel = channel
        channel.add_on_close_callback(self._channel_closed)
        channel.queue_declare(
            self.queue, durable=True, arguments=self.arguments, callback=self._declared
        )

    def _declared(self, _: Any) -> None:
        self.channel.queue_purge(self.queue, self._purged)

    def _purged(self, _: Any) -> None:
        self.channel.confirm_delivery(self._confirmed, callback=self._selected)

    def _selected(self, _: Any) -> None:
        self.started = time.perf_counter()
        self._fill()

    def _fill(self) -> None:
        while self.sent < self.count and len(self.outstanding) < self.window:
            self.channel.basic_publish("", self.queue, self.body, self.props)
            self.sent += 1
            self.outstanding.add(self.sent)

    def _confirmed(self, frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        done = {t for t in self.outstanding if t <= tag} if method.multiple else {tag}
        self.outstanding -= done
        if method.NAME == "Basic.Nack":
            self.nacked += len(done)
        self.confirmed += len(done)
        if self.confirmed >= self.count:
            self.finished = time.perf_counter()
            self.connection.close()  # the queue stays full for the consumer
            self.connection.ioloop.call_later(30, self._close_timeout)
            return
        self._fill()

    def _channel_closed(self, _: Any, reason: Any) -> None:
        # after the last message this is our own close: the connection's close stops the
        # loop once the broker has answered it (stopping here left the socket half-closed)
        if self.confirmed < self.count:
            self.error = f"channel closed: {reason}"
            self.connection.ioloop.stop()


class AckingConsumer:
    """Consume `count` messages with basic.qos(prefetch) and one ack each; time consume-ok to
    the last delivery; then delete the queue."""

    def __init__(self, params: pika.ConnectionParameters, queue: str, count: int,
                 prefetch: int) -> None:  # fmt: skip
        self.params, self.queue, self.count, self.prefetch = params, queue, count, prefetch
        self.received = 0
        self.redelivered = 0
        self.started = self.finished = 0.0
        self.error: str | None = None

    def run(self) -> dict[str, Any]:
        self.connection = SelectConnection(
            self.params,
            on_open_callback=self._opened,
            on_open_error_callback=self._failed,
            on_close_callback=self._closed,
        )
        self.connection.ioloop.start()
        if self.error:
            raise RuntimeError(self.error)
        seconds = self.finished - self.started
        rate = round(self.count / seconds, 1)
        return {"messages": self.count, "seconds": round(seconds, 3), "per_s": rate,
                "redelivered": self.redelivered}  # fmt: skip

    def _failed(self, _: Any, error: Any) -> None:
        self.error = f"connection failed: {error}"
        self.connection.ioloop.stop()

    def _closed(self, _: Any, reason: Any) -> None:
        self.connection.ioloop.stop()

    def _close_timeout(self) -> None:
        print(f"{type(self).__name__}: no Close-Ok in 30 s", file=sys.stderr, flush=True)
        self.connection.ioloop.stop()

    def _opened(self, connection: Any) -> None:
        connection.channel(on_open_callback=self._channel)

    def _channel(self, channel: Any) -> None:
        self.channel = channel
        channel.add_on_close_callback(self._channel_closed)
        channel.basic_qos(prefetch_count=self.prefetch, callback=self._qos)

    def _qos(self, _: Any) -> None:
        self.started = time.perf_counter()
        self.channel.basic_consume(self.queue, self._deliver)

    def _deliver(self, channel: Any, method: Any, _: Any, body: bytes) -> None:
        channel.basic_ack(method.delivery_tag)
        self.received += 1
        self.redelivered += bool(method.redelivered)
        if self.received == self.count:
            self.finished = time.perf_counter()
            channel.queue_delete(self.queue, callback=lambda _: self.connection.close())
            self.connection.ioloop.call_later(30, self._close_timeout)

    def _channel_closed(self, _: Any, reason: Any) -> None:
        # after the last message this is our own close: the connection's close stops the
        # loop once the broker has answered it (stopping here left the socket half-closed)
        if self.received < self.count:
            self.error = f"channel closed: {reason}"
            self.connection.ioloop.stop()


# -- Celery ----------------------------------------------------------------------------------


def without_bench(paths: list[str]) -> list[str]:
    """`paths` without bench/: this script is named amqp.py, and kombu imports py-amqp's
    `amqp`, which must not find this file instead."""
    return [p for p in paths if p and Path(p).resolve() != HERE]


def import_celery_app() -> Any:
    """amqp_celery.make_app, with kombu's `amqp` imported from site-packages first."""
    saved = sys.path[:]
    sys.path[:] = without_bench(sys.path)
    try:
        import kombu.exceptions  # noqa: F401, PLC0415
    finally:
        sys.path[:] = saved
    from amqp_celery import make_app  # noqa: PLC0415

    return make_app


@contextlib.contextmanager
def celery_worker(broker: Broker, tmp: Path) -> Iterator[Any]:
    """A Celery worker (prefork, 2 processes) on `broker`, and the app that sends it tasks.

    The worker runs in a temp dir of its own holding a copy of amqp_celery.py (bench/ is
    not on its path: see without_bench) and is stopped (warm shutdown) at the end."""
    make_app = import_celery_app()
    home = tmp / f"celery-{broker.name.split()[0].lower()}"
    home.mkdir()
    shutil.copy(HERE / "amqp_celery.py", home)
    path = without_bench(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    env = {**os.environ, "BENCH_CELERY_BROKER": broker.url, "PYTHONPATH": os.pathsep.join(path)}
    argv = [sys.executable, "-m", "celery", "-A", "amqp_celery", "worker", "--pool", "prefork",
            "--concurrency", "2", "--loglevel", "warning"]  # fmt: skip
    with (home / "worker.log").open("wb") as log:
        proc = subprocess.Popen(argv, cwd=home, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    app = make_app(broker.url)
    try:
        app.tasks["bench.add"].delay(0, 0).get(timeout=120)  # the worker is up and consuming
        yield app
    except Exception as exc:
        tail = (home / "worker.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"Celery on {broker.name}: {exc!r}; worker log: {tail}") from exc
    finally:
        app.close()
        stop(proc, timeout=60)


def celery_round(app: Any, tasks: int) -> dict[str, Any]:
    add = app.tasks["bench.add"]
    start = time.perf_counter()
    results = [add.delay(i, i) for i in range(tasks)]
    values = [r.get(timeout=300) for r in results]
    seconds = time.perf_counter() - start
    if values != [2 * i for i in range(tasks)]:
        raise RuntimeError("Celery returned wrong results")
    return {"messages": tasks, "seconds": round(seconds, 3), "per_s": round(tasks / seconds, 1)}


# -- the brokers ---------------------------------------------------------------------------


@contextlib.contextmanager
def pepsi_broker(tmp: Path) -> Iterator[Broker]:
    import psycopg  # noqa: PLC0415

    from pepsi.admin.accounts import amqp_users  # noqa: PLC0415

    dbname = f"pepsi_bench_amqp_{os.getpid()}"  # two runs at once do not share a database
    dsn = scratch_database(dbname)
    with psycopg.connect(dsn, autocommit=True) as conn:
        amqp_users.add_user(conn, USER, PASSWORD)
        amqp_users.set_permissions(conn, USER, ".*", ".*", ".*")
    port = free_port()
    conf = tmp / "pepsi.conf"
    conf.write_text(f"[pepsi-amqp]\nLISTEN = 127.0.0.1:{port}\n")  # defaults, plus the listener
    pepsi = Path(sys.executable).with_name("pepsi")
    proc = subprocess.Popen(
        [str(pepsi), "-c", str(conf), "-L", "warning", "dispatch", "serve"],
        env={**os.environ, "PEPSI_DSN": dsn},
        start_new_session=True,
    )
    try:
        if not wait_port(port, 30):
            raise RuntimeError("the Pepsi dispatcher did not start listening")
        credentials = pika.PlainCredentials(USER, PASSWORD)
        yield Broker(
            "Pepsi",
            pika.ConnectionParameters("127.0.0.1", port, credentials=credentials),
            f"amqp://{USER}:{PASSWORD}@127.0.0.1:{port}//",
            [proc.pid],
            postgres=postmaster_pid(server_dsn()),
            queues={"Pepsi": {}},
        )
    finally:
        stop(proc)
        drop_database(dbname)


@contextlib.contextmanager
def rabbitmq_broker(tmp: Path) -> Iterator[Broker | None]:
    """A throwaway RabbitMQ node, or None when it is not installed or does not start."""
    server = find_rabbitmq()  # the unwrapped script: the node runs as this user
    if server is None:
        yield None
        return
    ctl = str(Path(server).with_name("rabbitmqctl"))
    base = tmp / "rabbitmq"
    port, dist = free_port(), free_port()
    env = {
        **os.environ,
        "RABBITMQ_NODENAME": f"pepsibench{port}@localhost",
        "RABBITMQ_NODE_PORT": str(port),
        "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
        "RABBITMQ_DIST_PORT": str(dist),
        "RABBITMQ_MNESIA_BASE": f"{base}/mnesia",
        "RABBITMQ_LOG_BASE": f"{base}/log",
        "RABBITMQ_PID_FILE": f"{base}/pid",
        "RABBITMQ_ENABLED_PLUGINS_FILE": f"{base}/enabled_plugins",
        "HOME": str(base),
        # Idle schedulers of the Erlang VM spin before they sleep, taking CPU from
        # Pepsi's runs on a shared machine; RabbitMQ's advice for shared hosts.
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "+sbwt none +sbwtdcpu none +sbwtdio none",
    }
    for sub in ("mnesia", "log"):
        (base / sub).mkdir(parents=True)
    (base / "enabled_plugins").write_text("[].\n")
    proc = subprocess.Popen([str(server)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        if not wait_port(port, 90):
            print("rabbitmq-server did not start: skipped", file=sys.stderr)
            yield None
            return
        guest = pika.PlainCredentials("guest", "guest")
        yield Broker(
            "RabbitMQ",
            pika.ConnectionParameters("127.0.0.1", port, credentials=guest),
            f"amqp://guest:guest@127.0.0.1:{port}//",
            [proc.pid],
            queues={
                "RabbitMQ quorum": {"x-queue-type": "quorum"},
                "RabbitMQ classic": {"x-queue-type": "classic"},
            },
        )
    finally:
        subprocess.run([ctl, "-n", env["RABBITMQ_NODENAME"], "stop"], env=env,
                       capture_output=True, timeout=60, check=False)  # fmt: skip
        stop(proc, timeout=30)


def idle_latency(
    broker: Broker, queue: str, arguments: dict[str, Any], samples: int
) -> list[float]:
    """`samples` publish-to-callback times in ms on an idle `queue` (see the module doc)."""
    arrived: queue_module.Queue[float] = queue_module.Queue()
    consuming = threading.Event()

    def consume() -> None:
        connection = pika.BlockingConnection(broker.params)
        channel = connection.channel()
        channel.queue_declare(queue, durable=True, arguments=arguments)
        channel.basic_qos(prefetch_count=1)

        def on_message(ch: Any, method: Any, _: Any, body: bytes) -> None:
            arrived.put(time.perf_counter())
            ch.basic_ack(method.delivery_tag)
            if body == b"stop":
                ch.stop_consuming()

        channel.basic_consume(queue, on_message)
        consuming.set()
        channel.start_consuming()
        connection.close()

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    if not consuming.wait(30):
        raise RuntimeError(f"{broker.name}: the latency consumer did not start")
    connection = pika.BlockingConnection(broker.params)
    channel = connection.channel()
    channel.confirm_delivery()
    persistent = pika.BasicProperties(delivery_mode=2)
    times: list[float] = []
    for i in range(samples + LATENCY_WARM):
        time.sleep(0.02)
        start = time.perf_counter()
        channel.basic_publish("", queue, b"x" * 100, persistent)
        stamp = arrived.get(timeout=10)
        if i >= LATENCY_WARM:
            times.append((stamp - start) * 1000)
    channel.basic_publish("", queue, b"stop", persistent)
    arrived.get(timeout=10)
    thread.join(timeout=10)
    connection.close()
    return times


def latency_rep(
    brokers: list[Broker], latencies: dict[str, list[list[float]]], samples: int
) -> None:
    for broker in brokers:
        for system, arguments in broker.queues.items():
            quiet(brokers)
            name = "latency-" + system.lower().replace(" ", "-")
            times = idle_latency(broker, name, arguments, samples)
            latencies.setdefault(system, []).append(times)
            print(f"  {system}, idle latency: {statistics.median(times):.2f} ms",
                  file=sys.stderr, flush=True)  # fmt: skip


def latency_summary(latencies: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Per system: the median over the reps of each rep's median, p99 and max (and the
    reps' medians' range)."""
    out: dict[str, Any] = {}
    for system, reps in latencies.items():
        stats = [sorted(times) for times in reps]
        medians = [statistics.median(t) for t in stats]
        out[system] = {
            "median_ms": round(statistics.median(medians), 2),
            "min_median_ms": round(min(medians), 2),
            "max_median_ms": round(max(medians), 2),
            "p99_ms": round(
                statistics.median(t[min(len(t) - 1, int(len(t) * 0.99))] for t in stats), 2
            ),
            "max_ms": round(statistics.median(t[-1] for t in stats), 2),
            "samples": sum(len(t) for t in stats),
        }
    return out


# -- the run ---------------------------------------------------------------------------------


Cells = dict[str, dict[str, list[dict[str, Any]]]]  # system: cell: runs


def amqp_rep(brokers: list[Broker], cells: Cells, args: argparse.Namespace) -> None:
    """One rep of every AMQP cell, broker after broker, queue type after queue type."""
    for broker in brokers:
        for system, arguments in broker.queues.items():
            for body_name, size in BODIES.items():
                body = b"x" * size
                for prefetch in PREFETCHES:
                    quiet(brokers)
                    pub = WindowedPublisher(
                        broker.params, "bench", arguments, args.messages, args.window, body=body
                    )
                    add(cells, system, f"publish {body_name}", measured(broker, pub.run))
                    quiet(brokers)
                    con = AckingConsumer(broker.params, "bench", args.messages, prefetch)
                    cell = f"consume {body_name}, prefetch {prefetch}"
                    add(cells, system, cell, measured(broker, con.run))


def add(cells: Cells, system: str, cell: str, result: dict[str, Any]) -> None:
    cells.setdefault(system, {}).setdefault(cell, []).append(result)
    print(f"  {system}, {cell}: {result['per_s']:.0f}/s", file=sys.stderr, flush=True)


def summarize(cells: Cells) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for system, by_cell in cells.items():
        out[system] = {}
        for cell, runs in by_cell.items():
            rates = [r["per_s"] for r in runs]
            out[system][cell] = {
                "per_s": round(statistics.median(rates), 1),
                "min": min(rates),
                "max": max(rates),
                "cpu_ms_per_1k": {
                    role: round(statistics.median(r["cpu_ms_per_1k"][role] for r in runs), 1)
                    for role in runs[0].get("cpu_ms_per_1k", {})
                },
                "nacked": sum(r.get("nacked", 0) for r in runs),
                "redelivered": sum(r.get("redelivered", 0) for r in runs),
            }
    return out


def markdown(summary: dict[str, Any], args: argparse.Namespace) -> str:
    systems = list(summary)
    cells = list(dict.fromkeys(c for s in systems for c in summary[s]))
    lines = [
        f"AMQP, {args.messages} persistent messages a cell (Celery: {args.celery_tasks} tasks),"
        f" confirm window {args.window}, {args.reps} reps: msg/s median (min–max); CPU ms per"
        " 1 000 messages of the broker (+ PostgreSQL, the whole server, for Pepsi).",
        "",
        "| cell | " + " | ".join(systems) + " | Pepsi ÷ best RabbitMQ |",
        "|---|" + "---:|" * (len(systems) + 1),
    ]
    for cell in cells:
        texts, rabbit = [], []
        for s in systems:
            c = summary[s].get(cell)
            if not c:
                texts.append("–")
                continue
            cpu = c["cpu_ms_per_1k"]
            used = cpu.get("broker", 0) + cpu.get("postgres", 0)
            texts.append(f"{c['per_s']:,.0f} ({c['min']:,.0f}–{c['max']:,.0f}); CPU {used:,.0f}")
            if s.startswith("RabbitMQ"):
                rabbit.append(c["per_s"])
        pepsi = summary.get("Pepsi", {}).get(cell, {}).get("per_s")
        ratio = f"{pepsi / max(rabbit):.2f}" if pepsi and rabbit else "–"
        lines.append(f"| {cell} | " + " | ".join(texts).replace(",", " ") + f" | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--celery-tasks", type=int, default=2000)
    parser.add_argument("--no-celery", action="store_true")
    parser.add_argument("--latency-samples", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cells: Cells = {}
    with (
        tempfile.TemporaryDirectory(prefix="pepsi-bench-amqp-") as tmp,
        pepsi_broker(Path(tmp)) as pepsi,
        rabbitmq_broker(Path(tmp)) as rabbit,
    ):
        brokers = [pepsi] + ([rabbit] if rabbit else [])
        latencies: dict[str, list[list[float]]] = {}
        for _ in range(args.reps):
            amqp_rep(brokers, cells, args)
            if args.latency_samples > 0:
                latency_rep(brokers, latencies, args.latency_samples)
        if not args.no_celery:
            with contextlib.ExitStack() as stack:
                apps = [(b, stack.enter_context(celery_worker(b, Path(tmp)))) for b in brokers]
                cell = f"Celery round trip, {args.celery_tasks} add.delay + get"
                for _ in range(args.reps):
                    for broker, app in apps:
                        quiet(brokers)
                        system = "Pepsi" if broker is pepsi else "RabbitMQ classic"
                        run = lambda app=app: celery_round(app, args.celery_tasks)  # noqa: E731
                        add(cells, system, cell, measured(broker, run))
    summary = summarize(cells)
    result: dict[str, Any] = {
        "benchmark": "amqp",
        "messages": args.messages,
        "window": args.window,
        "reps": args.reps,
        "celery_tasks": None if args.no_celery else args.celery_tasks,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "cells": summary,
        "latency": latency_summary(latencies),
        "rabbitmq": "RabbitMQ quorum" in summary,
    }
    text = json.dumps(result, indent=2, ensure_ascii=False)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    print()
    print(markdown(summary, args))
    if result["latency"]:
        print()
        print(latency_markdown(result["latency"], args.latency_samples))
    print("SUMMARY amqp " + summary_line(summary) + latency_line(result["latency"]))
    return 0


def latency_markdown(latency: dict[str, Any], samples: int) -> str:
    lines = [
        f"Idle latency, publish with confirm → consumer (prefetch 1), {samples} samples"
        " 20 ms apart a rep: ms, median over the reps (range of the reps' medians).",
        "",
        "| system | median | p99 | max |",
        "|---|---:|---:|---:|",
    ]
    for system, c in latency.items():
        lines.append(
            f"| {system} | {c['median_ms']:.2f} ({c['min_median_ms']:.2f}–{c['max_median_ms']:.2f})"
            f" | {c['p99_ms']:.1f} | {c['max_ms']:.1f} |"
        )
    return "\n".join(lines)


def latency_line(latency: dict[str, Any]) -> str:
    """Pepsi's idle latency ÷ the best RabbitMQ queue type's ("" without both)."""
    pepsi = latency.get("Pepsi")
    rabbit = [c["median_ms"] for name, c in latency.items() if name.startswith("RabbitMQ")]
    if not pepsi or not rabbit:
        return ""
    ratio = pepsi["median_ms"] / min(rabbit)
    return f"; idle latency Pepsi {pepsi['median_ms']:.2f} ms = {ratio:.2f}x RabbitMQ"


def summary_line(summary: dict[str, Any]) -> str:
    """Pepsi ÷ the best RabbitMQ queue type, cell by cell."""
    parts = []
    for cell, c in summary.get("Pepsi", {}).items():
        rabbit = [s[cell]["per_s"] for name, s in summary.items() if name != "Pepsi" and cell in s]
        ratio = f" = {c['per_s'] / max(rabbit):.2f}x RabbitMQ" if rabbit else ""
        parts.append(f"{cell}: Pepsi {c['per_s']:.0f}/s{ratio}")
    return "; ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
