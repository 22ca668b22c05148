"""What the web console costs the pipeline: the drain rate with the console closed and open.

    .venv/bin/python bench/web.py [-n 20000] [--reps 3] [--live-every 0.5] [--stage-every 2]
                                  [--no-warmup] [--json FILE]

On a scratch database `pepsi_bench_web` (the embedded or $PEPSI_DSN's server), a
dispatcher runs a 2-stage pipeline s1 -> s2 of the DEFAULT configuration (only
HANDLER and NEXT; the no-op stage of bench/race_stages.py). Each run starts a
fresh dispatcher, warms it (200 messages through), publishes N messages in
batches of 1 000 and times from just before the first publish until the queue
is empty (polled every 10 ms). A first drain, console closed, is not counted
(on a fresh database the first one is markedly slower). Two modes, both in each
rep, their order swapped from one rep to the next (closed open, open closed, ...):

  closed  no console
  open    the dispatcher serves the console ([pepsi-web] LISTEN on 127.0.0.1, no
          password: loopback, read-only) and a client thread fetches the
          overview's live fragment (/overview/live) every 0.5 s (--live-every)
          and the stage page (/stage/s1) every 2 s (--stage-every) during the
          drain: four times the fetches of one browser tab on the overview
          (`--live-every 2 --stage-every 0` is one tab).

Per run: messages per second, the dispatcher's own CPU per 1 000 messages (the
console shares its process and event loop), the machine's load average at its end
(a run next to a much higher one was disturbed by something else) and, open, the
client's requests and their latency. Prints a JSON document (also to --json
FILE) and one SUMMARY line: the median drain rate closed vs open and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from datetime import UTC, datetime
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any

import psutil
import psycopg
from common import scratch_database

from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher
from pepsi.web import tokens

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DATABASE = "pepsi_bench_web"
BATCH = 1000
POLL = 0.01  # seconds between two looks at the queue
WARM = 200
LIVE_EVERY = 0.5  # seconds between two fetches of /overview/live
STAGE_EVERY = 2.0  # seconds between two fetches of /stage/s1
PIPELINE = (
    "[stage-s1]\nHANDLER = race_stages:noop\nNEXT = s2\n[stage-s2]\nHANDLER = race_stages:noop\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(POLL)


class Client(threading.Thread):
    """Fetches the overview fragment every LIVE_EVERY s and the stage page every STAGE_EVERY s."""

    def __init__(self, link: str, live_every: float, stage_every: float) -> None:
        """`link`: the console's link with its token (no PASSWORD here), opened first."""
        super().__init__(daemon=True)
        self.base = link.split("/?", 1)[0]
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
        with self.opener.open(link, timeout=10) as response:  # the token for a session
            response.read()
        self.live_every = live_every
        self.stage_every = stage_every
        self.halt = threading.Event()
        self.latencies: dict[str, list[float]] = {"/overview/live": [], "/stage/s1": []}
        self.errors: list[str] = []

    def fetch(self, path: str) -> None:
        started = time.perf_counter()
        try:
            with self.opener.open(self.base + path, timeout=10) as response:
                response.read()
                if response.status != 200:
                    self.errors.append(f"{path}: HTTP {response.status}")
        except OSError as exc:
            self.errors.append(f"{path}: {exc}")
            return
        self.latencies[path].append(time.perf_counter() - started)

    def run(self) -> None:
        start = time.monotonic()
        ticks = 0
        per_stage = round(self.stage_every / self.live_every) if self.stage_every else 0
        while not self.halt.is_set():
            self.fetch("/overview/live")
            if per_stage and ticks % per_stage == 0:
                self.fetch("/stage/s1")
            ticks += 1
            self.halt.wait(max(0.0, start + ticks * self.live_every - time.monotonic()))

    def stop(self) -> dict[str, Any]:
        self.halt.set()
        self.join(15)
        out: dict[str, Any] = {"errors": self.errors[:5], "error_count": len(self.errors)}
        for path, measured in self.latencies.items():
            times = sorted(measured)
            out[path] = {
                "requests": len(times),
                "median_ms": round(statistics.median(times) * 1000, 1) if times else None,
                "max_ms": round(times[-1] * 1000, 1) if times else None,
            }
        return out


class Bench:
    def __init__(self, tmp: Path, dsn: str, live_every: float, stage_every: float) -> None:
        self.tmp = tmp
        self.dsn = dsn
        self.live_every = live_every
        self.stage_every = stage_every
        self.db = psycopg.connect(dsn, autocommit=True)
        self.runs = 0

    def empty(self) -> bool:
        row = self.db.execute("SELECT EXISTS (SELECT 1 FROM pepsi.workqueue)").fetchone()
        return not (row and row[0])

    def start(self, conf: Path, log: Path) -> subprocess.Popen[bytes]:
        # its console's token file in a folder of this run's (pepsi.web.tokens)
        env = {**os.environ, "PEPSI_DSN": self.dsn, "PYTHONPATH": str(BENCH)}
        env["XDG_DATA_HOME"] = str(self.tmp / "xdg")
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pepsi", "-c", str(conf), "dispatch", "serve"],
                env=env,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

        def started() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the dispatcher exited: {log.read_text()[-600:]}")
            return "dispatching" in log.read_text(errors="replace")

        wait_for("the dispatcher to start", started, 60)
        return proc

    def run(self, mode: str, n: int) -> dict[str, Any]:
        """One measured drain of n messages, with the console closed or open."""
        self.runs += 1
        port = free_port()
        conf = self.tmp / f"{mode}.conf"
        text = PIPELINE
        if mode == "open":
            text += f"[pepsi-web]\nLISTEN = 127.0.0.1:{port}\n"
        conf.write_text(text)
        self.db.execute("TRUNCATE pepsi.workqueue, pepsi.workqueue_body CASCADE")
        log = self.tmp / f"dispatch-{self.runs}-{mode}.log"
        proc = self.start(conf, log)
        client: Client | None = None
        try:
            if mode == "open":
                wait_for(
                    "the console",
                    lambda: "web console at" in log.read_text(errors="replace"),
                    30,
                )
            publisher = Publisher.connect(load_config(conf), self.dsn)
            try:
                publisher.publish_many([OutgoingMessage("s1")] * WARM)
                wait_for("the warm-up to drain", self.empty, 60)
                if mode == "open":
                    (console,) = tokens.running(self.tmp / "xdg" / "pepsi" / "web")
                    client = Client(console.link, self.live_every, self.stage_every)
                    client.start()
                dispatcher = psutil.Process(proc.pid)
                cpu_before = sum(dispatcher.cpu_times()[:2])
                batches = [[OutgoingMessage("s1")] * min(BATCH, n - i) for i in range(0, n, BATCH)]
                started = time.perf_counter()
                for batch in batches:
                    publisher.publish_many(batch)
                wait_for(f"{n} messages to drain", self.empty, 60 + n / 50)
                seconds = time.perf_counter() - started
                cpu = sum(dispatcher.cpu_times()[:2]) - cpu_before
            finally:
                publisher.close()
            result: dict[str, Any] = {
                "mode": mode,
                "messages": n,
                "seconds": round(seconds, 3),
                "per_s": round(n / seconds, 1),
                "dispatcher_cpu_ms_per_1k": round(cpu / n * 1e6, 1),
                # the machine's 1-minute load at the end: high next to a low one, disturbed
                "load_1m": round(os.getloadavg()[0], 2),
            }
            if client is not None:
                result["client"] = client.stop()
                client = None
            return result
        finally:
            if client is not None:
                client.stop()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        self.db.close()


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("closed", "open"):
        rates = [r["per_s"] for r in runs if r["mode"] == mode]
        cpu = [r["dispatcher_cpu_ms_per_1k"] for r in runs if r["mode"] == mode]
        out[mode] = {
            "median_per_s": round(statistics.median(rates), 1),
            "min_per_s": min(rates),
            "max_per_s": max(rates),
            "dispatcher_cpu_ms_per_1k": round(statistics.median(cpu), 1),
        }
    out["ratio_open_closed"] = round(out["open"]["median_per_s"] / out["closed"]["median_per_s"], 3)
    requests = [r["client"] for r in runs if "client" in r]
    out["console_requests"] = sum(
        c[path]["requests"] for c in requests for path in ("/overview/live", "/stage/s1")
    )
    out["console_errors"] = sum(c["error_count"] for c in requests)
    live = [c["/overview/live"]["median_ms"] for c in requests if c["/overview/live"]["median_ms"]]
    out["overview_live_median_ms"] = round(statistics.median(live), 1) if live else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--messages", type=int, default=20_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--live-every",
        type=float,
        default=LIVE_EVERY,
        help=f"seconds between two fetches of /overview/live (default {LIVE_EVERY}; a tab: 2)",
    )
    parser.add_argument(
        "--stage-every",
        type=float,
        default=STAGE_EVERY,
        help=f"seconds between two fetches of /stage/s1 (default {STAGE_EVERY}; 0: never)",
    )
    parser.add_argument(
        "--no-warmup",
        dest="warmup",
        action="store_false",
        help="skip the first, uncounted drain (a fresh database drains slower at first)",
    )
    parser.add_argument("--json", type=Path, help="also write the JSON document here")
    args = parser.parse_args()

    dsn = scratch_database(DATABASE)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pepsi-bench-web-") as tmp:
        bench = Bench(Path(tmp), dsn, args.live_every, args.stage_every)
        try:
            if args.warmup:  # the first drain on a fresh database is slower: not counted
                print(json.dumps({"warmup": bench.run("closed", args.messages)}), file=sys.stderr)
            for rep in range(args.reps):
                order = ("closed", "open") if rep % 2 == 0 else ("open", "closed")
                for mode in order:
                    result = bench.run(mode, args.messages)
                    result["rep"] = rep + 1
                    runs.append(result)
                    print(json.dumps(result), file=sys.stderr, flush=True)
        finally:
            bench.close()
    summary = summarize(runs)
    document = {
        "benchmark": "web",
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "messages": args.messages,
        "reps": args.reps,
        "pipeline": "2 stages s1 -> s2, default configuration, no-op handlers",
        "client": f"/overview/live every {args.live_every} s, /stage/s1 every "
        + (f"{args.stage_every} s" if args.stage_every else "never"),
        "runs": runs,
        "summary": summary,
    }
    text = json.dumps(document, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    closed, opened = summary["closed"], summary["open"]
    print(
        f"SUMMARY web console: drain {closed['median_per_s']:.0f} msg/s closed vs "
        f"{opened['median_per_s']:.0f} msg/s open (ratio {summary['ratio_open_closed']:.3f}); "
        f"dispatcher CPU {closed['dispatcher_cpu_ms_per_1k']:.0f} vs "
        f"{opened['dispatcher_cpu_ms_per_1k']:.0f} ms per 1 000 messages; "
        f"{summary['console_requests']} console requests, {summary['console_errors']} errors"
    )


if __name__ == "__main__":
    main()
