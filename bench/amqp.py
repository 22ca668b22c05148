"""AMQP throughput: pika publishing with a confirm window, then consuming with manual
acks, Pepsi next to RabbitMQ (issue 16).

    .venv/bin/python bench/amqp.py [--messages 20000] [--window 1000] [--prefetch 100]
                                   [--reps 3]

Persistent 1 KB messages published with pika's asynchronous SelectConnection,
at most --window unconfirmed (acks with multiple=True free the window), to one
queue through the default exchange; the rate counts from the first publish to
the last confirm. Then one consumer takes them back with basic.qos --prefetch
and one basic.ack per message; the rate counts from consume-ok to the last
delivery. Against:

- Pepsi: `pepsi dispatch` with its default configuration plus `[pepsi-amqp]
  LISTEN` (the dispatcher's claim feeds AMQP consumers), in a process of its
  own, on a scratch database `pepsi_bench_amqp` of the embedded (or
  $PEPSI_DSN) server; a classic queue (every Pepsi queue is a durable stage);
- RabbitMQ, when `rabbitmq-server` is installed and starts: a node of its own
  in a temporary directory on a free port, a quorum queue. Nothing is installed;
  RabbitMQ is skipped when absent.

Runs alternate between the brokers, each phase starting once the machine is
quiet (the other broker's background work done); the median counts. Prints one JSON document
and a summary line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
from common import scratch_database
from pika.adapters.select_connection import SelectConnection

BODY = b"x" * 1024
USER, PASSWORD = "bench", "bench-secret"


def busy_fraction(seconds: float = 0.5) -> float:
    """How busy the machine's CPUs were over `seconds` (0 idle, 1 saturated), from
    /proc/stat; 0 where it cannot be read."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1 - (idle1 - idle0) / max(total1 - total0, 1)


def quiet(limit: float = 0.15, timeout: float = 20.0) -> None:
    """Wait until the other broker's background work (a node's start, a quorum queue's
    compaction after a run) has died down, so each run measures its own broker."""
    deadline = time.monotonic() + timeout
    while busy_fraction() > limit and time.monotonic() < deadline:
        pass


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


# -- the publisher -------------------------------------------------------------------------


class WindowedPublisher:
    """Publish `count` messages, at most `window` unconfirmed; time first publish to last ack."""

    def __init__(self, params: pika.ConnectionParameters, queue: str, arguments: dict[str, Any],
                 count: int, window: int) -> None:  # fmt: skip
        self.params, self.queue, self.arguments = params, queue, arguments
        self.count, self.window = count, window
        self.sent = self.confirmed = self.nacked = 0
        self.outstanding: set[int] = set()
        self.started = self.finished = 0.0
        self.error: str | None = None
        self.props = pika.BasicProperties(delivery_mode=2, content_type="application/octet-stream")

    def run(self) -> dict[str, Any]:
        self.connection = SelectConnection(
            self.params, on_open_callback=self._opened, on_open_error_callback=self._failed
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
            self.channel.basic_publish("", self.queue, BODY, self.props)
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
            self.connection.ioloop.call_later(5, self.connection.ioloop.stop)
            return
        self._fill()

    def _channel_closed(self, _: Any, reason: Any) -> None:
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
            self.params, on_open_callback=self._opened, on_open_error_callback=self._failed
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
            self.connection.ioloop.call_later(5, self.connection.ioloop.stop)

    def _channel_closed(self, _: Any, reason: Any) -> None:
        if self.received < self.count:
            self.error = f"channel closed: {reason}"
        self.connection.ioloop.stop()


# -- the brokers ---------------------------------------------------------------------------


@contextlib.contextmanager
def pepsi_broker() -> Iterator[pika.ConnectionParameters]:
    import psycopg  # noqa: PLC0415

    from pepsi.admin.accounts import amqp_users  # noqa: PLC0415

    dsn = scratch_database("pepsi_bench_amqp")
    with psycopg.connect(dsn, autocommit=True) as conn:
        amqp_users.add_user(conn, USER, PASSWORD)
        amqp_users.set_permissions(conn, USER, ".*", ".*", ".*")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pepsi-bench-amqp-") as tmp:
        conf = Path(tmp, "pepsi.conf")
        conf.write_text(f"[pepsi-amqp]\nLISTEN = 127.0.0.1:{port}\n")
        pepsi = Path(sys.executable).with_name("pepsi")
        proc = subprocess.Popen(
            [str(pepsi), "-c", str(conf), "-L", "warning", "dispatch", "serve"],
            env={**os.environ, "PEPSI_DSN": dsn},
        )
        try:
            if not wait_port(port, 30):
                raise RuntimeError("the Pepsi dispatcher did not start listening")
            yield pika.ConnectionParameters(
                "127.0.0.1", port, credentials=pika.PlainCredentials(USER, PASSWORD)
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@contextlib.contextmanager
def rabbitmq_broker() -> Iterator[pika.ConnectionParameters | None]:
    """A throwaway RabbitMQ node, or None when it is not installed or does not start."""
    server = shutil.which("rabbitmq-server") or (
        "/usr/sbin/rabbitmq-server" if Path("/usr/sbin/rabbitmq-server").exists() else None
    )
    if server is None:
        yield None
        return
    ctl = str(Path(server).with_name("rabbitmqctl"))
    with tempfile.TemporaryDirectory(prefix="pepsi-bench-rabbit-") as tmp:
        port, dist = free_port(), free_port()
        env = {
            **os.environ,
            "RABBITMQ_NODENAME": f"pepsibench{port}@localhost",
            "RABBITMQ_NODE_PORT": str(port),
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_DIST_PORT": str(dist),
            "RABBITMQ_MNESIA_BASE": f"{tmp}/mnesia",
            "RABBITMQ_LOG_BASE": f"{tmp}/log",
            "RABBITMQ_PID_FILE": f"{tmp}/pid",
            "RABBITMQ_ENABLED_PLUGINS_FILE": f"{tmp}/enabled_plugins",
            "HOME": tmp,
            # Idle schedulers of the Erlang VM spin before they sleep, taking CPU from
            # Pepsi's runs on a shared machine; RabbitMQ's advice for shared hosts.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "+sbwt none +sbwtdcpu none +sbwtdio none",
        }
        for sub in ("mnesia", "log"):
            Path(tmp, sub).mkdir()
        Path(f"{tmp}/enabled_plugins").write_text("[].\n")
        if os.geteuid() == 0:  # Debian's wrapper runs the node as the rabbitmq user
            with contextlib.suppress(LookupError, OSError):
                for path in (Path(tmp), *Path(tmp).rglob("*")):
                    shutil.chown(path, "rabbitmq", "rabbitmq")
        proc = subprocess.Popen([server], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            if not wait_port(port, 90):
                print("rabbitmq-server did not start: skipped", file=sys.stderr)
                yield None
                return
            yield pika.ConnectionParameters(
                "127.0.0.1", port, credentials=pika.PlainCredentials("guest", "guest")
            )
        finally:
            subprocess.run([ctl, "-n", env["RABBITMQ_NODENAME"], "stop"], env=env,
                           capture_output=True, timeout=60, check=False)  # fmt: skip
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--prefetch", type=int, default=100)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        "pepsi": {"publish": [], "consume": []},
        "rabbitmq_quorum": {"publish": [], "consume": []},
    }

    def one(name: str, params: pika.ConnectionParameters, arguments: dict[str, Any]) -> None:
        quiet()
        publisher = WindowedPublisher(params, "bench", arguments, args.messages, args.window)
        runs[name]["publish"].append(publisher.run())
        quiet()
        consumer = AckingConsumer(params, "bench", args.messages, args.prefetch)
        runs[name]["consume"].append(consumer.run())

    with pepsi_broker() as pepsi, rabbitmq_broker() as rabbit:
        for _ in range(args.reps):
            one("pepsi", pepsi, {})
            if rabbit is not None:
                one("rabbitmq_quorum", rabbit, {"x-queue-type": "quorum"})
    result: dict[str, Any] = {
        "benchmark": "amqp",
        "messages": args.messages,
        "window": args.window,
        "prefetch": args.prefetch,
        "body_bytes": len(BODY),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    for name, phases in runs.items():
        result[name] = None
        if phases["publish"]:
            result[name] = {
                phase: {
                    "per_s": statistics.median(r["per_s"] for r in measured),
                    "all_per_s": sorted(r["per_s"] for r in measured),
                }
                for phase, measured in phases.items()
            }
            result[name]["publish"]["nacked"] = sum(r["nacked"] for r in phases["publish"])
            result[name]["consume"]["redelivered"] = sum(
                r["redelivered"] for r in phases["consume"]
            )
    print(json.dumps(result, indent=2))
    for phase, detail in (("publish", f"window {args.window}"),
                          ("consume", f"prefetch {args.prefetch}, manual ack")):  # fmt: skip
        pepsi_rate = result["pepsi"][phase]["per_s"]
        rabbit = result["rabbitmq_quorum"]
        tail = (
            f", RabbitMQ quorum {rabbit[phase]['per_s']:.0f}/s" if rabbit else ", RabbitMQ skipped"
        )
        print(f"amqp {phase}, {detail}: Pepsi {pepsi_rate:.0f}/s{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
