"""Throughput and latency of the pipeline with no-op stages.

    .venv/bin/python bench/pipeline.py [--messages 5000] [--samples 200]

Runs on the embedded server (or $PEPSI_DSN's server) in a scratch database
`pepsi_bench`, recreated each run. Prints one JSON document and a summary line:
- throughput: messages/s through a 1-stage and a 3-stage pipeline of no-op
  metadata-only stages in the default configuration (only HANDLER and NEXT),
  measured from the commit of a burst of N messages to the last one
  finishing, the pipeline warmed by 200 messages beforehand;
- latency: publish-confirm to finish on an idle 1-stage pipeline (median, p99).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from common import scratch_database

from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DB = "pepsi_bench"


def stage_config(names: list[str], last: str = "noop") -> str:
    text = ""  # the defaults are the product: no tuning
    for i, name in enumerate(names):
        handler = last if i == len(names) - 1 else "noop"
        text += f"[stage-{name}]\nHANDLER = bench_stages:{handler}\n"
        if i + 1 < len(names):
            text += f"NEXT = {names[i + 1]}\n"
    return text


class Run:
    def __init__(self, dsn: str, conf_text: str, tmp: Path) -> None:
        self.dsn = dsn
        self.conf = tmp / f"bench-{abs(hash(conf_text))}.conf"
        self.conf.write_text(conf_text)
        self.config = load_config(self.conf)
        self.db = psycopg.connect(dsn, autocommit=True)
        self.publisher = Publisher.connect(self.config, dsn)
        env = {**os.environ, "PEPSI_DSN": dsn, "PYTHONPATH": f"{HERE}{os.pathsep}{REPO / 'src'}"}
        self.log = tmp / "dispatch.log"
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pepsi", "-c", str(self.conf), "dispatch", "serve"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )

    def remaining(self) -> int:
        row = self.db.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
        return int(row[0]) if row else 0

    def drain(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.remaining():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"pipeline did not drain; see {self.log}")
            time.sleep(0.01)

    def warm(self, first: str) -> None:
        """Start every worker of the pool before measuring (startup is not throughput)."""
        self.publish(first, 200)
        self.drain()

    def publish(self, stage: str, count: int) -> list[int]:
        return self.publisher.publish_many([OutgoingMessage(stage)] * count)

    def close(self) -> None:
        self.publisher.close()
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.db.close()


def throughput(dsn: str, stages: int, messages: int, tmp: Path) -> dict[str, float]:
    names = [f"s{i + 1}" for i in range(stages)]
    run = Run(dsn, stage_config(names), tmp)
    try:
        run.warm(names[0])
        start = time.perf_counter()
        run.publish(names[0], messages)
        run.drain()
        elapsed = time.perf_counter() - start
    finally:
        run.close()
    return {
        "stages": stages,
        "messages": messages,
        "seconds": round(elapsed, 3),
        "messages_per_s": round(messages / elapsed, 1),
        "stage_passes_per_s": round(messages * stages / elapsed, 1),
    }


def latency(dsn: str, samples: int, tmp: Path) -> dict[str, float]:
    run = Run(dsn, stage_config(["only"], last="finish_notify"), tmp)
    listener = psycopg.connect(dsn, autocommit=True)
    listener.execute("LISTEN bench_done")
    try:
        run.warm("only")
        for _ in listener.notifies(timeout=0.5):
            pass
        times = []
        for _ in range(samples):
            time.sleep(0.02)  # let the pipeline go idle between samples
            start = time.perf_counter()
            (wid,) = run.publish("only", 1)
            for note in listener.notifies(timeout=10):
                if note.payload == str(wid):
                    break
            else:
                raise RuntimeError(f"message {wid} did not finish in 10 s")
            times.append((time.perf_counter() - start) * 1000)
    finally:
        listener.close()
        run.close()
    times.sort()
    return {
        "samples": samples,
        "median_ms": round(statistics.median(times), 2),
        "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2),
        "max_ms": round(times[-1], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    dsn = scratch_database(DB)
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "throughput": [
                throughput(dsn, 1, args.messages, Path(tmp)),
                throughput(dsn, 3, args.messages, Path(tmp)),
            ],
            "latency": latency(dsn, args.samples, Path(tmp)),
        }
    print(json.dumps(results, indent=2))
    one, three = results["throughput"]
    lat = results["latency"]
    print(
        f"SUMMARY 1 stage {one['messages_per_s']:.0f} msg/s; 3 stages {three['messages_per_s']:.0f}"
        f" msg/s ({three['stage_passes_per_s']:.0f} passes/s); publish->finish median"
        f" {lat['median_ms']:.1f} ms, p99 {lat['p99_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
