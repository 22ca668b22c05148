"""Publish throughput: confirms/s next to the database's raw INSERT rate.

    .venv/bin/python bench/publish.py [--messages 5000] [--reps 3]

All in one run, 1 KB bodies, on a scratch database `pepsi_bench_publish`:
- raw INSERT, one row per commit (the commit limit of this machine; again
  through psycopg's AsyncConnection, the async publish's own baseline) and
  1 000 rows per commit (the row limit; its bytea[] sent as text, as psycopg
  does for `%s`, and in binary with `%b`), into a table with just a key;
- publish one message per call (one confirm each), sync and async;
- publish_many in batches of 100 and of 1 000;
- the async pipeline (up to 1 000 unconfirmed, batches of up to 500, two
  connections).
Each measurement runs --reps times (raw and Pepsi's in turn, so a noisy
neighbour hurts both alike); the median counts. Besides rates, the CPU a
message costs this process and its connections' backends (read from /proc
when the server runs on this machine), steadier than rates on a busy one.
Prints one JSON document and two summary lines. `--drain BACKLOG` runs it all
while a dispatcher drains a backlog (and the messages published), as a
publisher meets a running pipeline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from common import process_cpu, scratch_database

from pepsi.config import load_config
from pepsi.publishing import AsyncPublisher, OutgoingMessage, Publisher

BODY = b"x" * 1024
CONF = "[stage-inbound]\nHANDLER = bench_stages:noop\n"


def backend_cpu(pids: list[int]) -> float | None:
    """CPU seconds of these server processes (None: not on this machine, or gone)."""
    total = 0.0
    for pid in pids:
        try:
            total += process_cpu(pid)
        except OSError:
            return None
    return total


def backends(dsn: str, application_name: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = %s",
            (application_name,),
        ).fetchall()
    return [int(pid) for (pid,) in rows]


def timed(count: int, run: Callable[[], object], pids: list[int] | None = None) -> dict[str, float]:
    """Rate, and CPU µs per message: this process (client) and `pids` (their backends)."""
    cpu, server = time.process_time(), backend_cpu(pids or [])
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    result = {"messages": count, "seconds": round(seconds, 3), "per_s": round(count / seconds, 1)}
    result["client_cpu_us"] = round((time.process_time() - cpu) / count * 1e6, 1)
    after = backend_cpu(pids or [])
    if pids and server is not None and after is not None:
        result["backend_cpu_us"] = round((after - server) / count * 1e6, 1)
    return result


def median(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per measurement, the run with the median rate (and every rate seen)."""
    result: dict[str, dict[str, Any]] = {}
    for name in runs[0]:
        ranked = sorted((run[name] for run in runs), key=lambda r: r["per_s"])
        result[name] = {**ranked[len(ranked) // 2], "all_per_s": [r["per_s"] for r in ranked]}
        result[name]["per_s"] = statistics.median(r["per_s"] for r in ranked)
    return result


def raw_inserts(dsn: str, n: int) -> dict[str, dict[str, float]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS raw (id bigserial PRIMARY KEY, body bytea)")
        conn.execute("SET synchronous_commit = on")

        def one_per_commit() -> None:
            for _ in range(n):
                conn.execute("INSERT INTO raw (body) VALUES (%s)", (BODY,))

        def thousand_per_commit() -> None:
            for _ in range(max(1, n // 1000)):
                conn.execute(
                    "INSERT INTO raw (body) SELECT b FROM unnest(%s::bytea[]) b", ([BODY] * 1000,)
                )

        def thousand_per_commit_binary() -> None:
            for _ in range(max(1, n // 1000)):
                conn.execute(
                    "INSERT INTO raw (body) SELECT b FROM unnest(%b::bytea[]) b", ([BODY] * 1000,)
                )

        pid = [conn.info.backend_pid]
        return {
            "one_row_per_commit": timed(n, one_per_commit, pid),
            "one_row_per_commit_async": raw_async(dsn, n),
            "1000_rows_per_commit": timed(max(1, n // 1000) * 1000, thousand_per_commit, pid),
            "1000_rows_per_commit_binary": timed(
                max(1, n // 1000) * 1000, thousand_per_commit_binary, pid
            ),
        }


def raw_async(dsn: str, n: int) -> dict[str, float]:
    """One row per commit through an AsyncConnection, in a loop of its own as the async
    publish runs: what asyncio and psycopg's async path cost before Pepsi's part."""
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(psycopg.AsyncConnection.connect(dsn, autocommit=True))

    async def one_per_commit() -> None:
        for _ in range(n):
            await conn.execute("INSERT INTO raw (body) VALUES (%s)", (BODY,))

    try:
        loop.run_until_complete(conn.execute("SET synchronous_commit = on"))
        pid = [conn.info.backend_pid]
        return timed(n, lambda: loop.run_until_complete(one_per_commit()), pid)
    finally:
        loop.run_until_complete(conn.close())
        loop.close()


def publishes(dsn: str, conf: Path, n: int) -> dict[str, dict[str, float]]:
    config = load_config(conf)
    msg = OutgoingMessage("inbound", BODY)
    with Publisher(config, dsn) as pub:

        def batches(size: int) -> Callable[[], None]:
            def run() -> None:
                for _ in range(max(1, n // size)):
                    pub.publish_many([msg] * size)

            return run

        pids = backends(dsn, "pepsi-publish")
        results = {
            "single": timed(n, lambda: [pub.publish("inbound", BODY) for _ in range(n)], pids),
            "batch_100": timed(max(1, n // 100) * 100, batches(100), pids),
            "batch_1000": timed(max(1, n // 1000) * 1000, batches(1000), pids),
        }

    loop = asyncio.new_event_loop()
    apub = loop.run_until_complete(AsyncPublisher.connect(config, dsn))

    async def singles() -> None:
        for _ in range(n):
            await apub.publish("inbound", BODY)

    pids = backends(dsn, "pepsi-publish")
    results["async_single"] = timed(n, lambda: loop.run_until_complete(singles()), pids)
    loop.run_until_complete(apub.close())
    loop.close()

    async def pipelined() -> None:
        apub = await AsyncPublisher.connect(config, dsn)
        pipe = apub.pipeline(max_outstanding=1000, max_batch=500, concurrency=2)
        async with apub, pipe:
            futures = [await pipe.submit(msg) for _ in range(n * 2)]
            await asyncio.gather(*futures)

    results["async_pipelined"] = timed(n * 2, lambda: asyncio.run(pipelined()))
    return results


DRAIN_CONF = "[stage-backlog]\nHANDLER = bench_stages:noop\n"


def draining(dsn: str, conf: Path, backlog: int) -> subprocess.Popen[bytes]:
    """A dispatcher serving `conf`, started once `backlog` messages wait in stage backlog."""
    config = load_config(conf)
    with Publisher(config, dsn) as pub:
        for start in range(0, backlog, 1000):
            pub.publish_many([OutgoingMessage("backlog", BODY)] * min(1000, backlog - start))
    # its workers import the handler from bench/ (bench_stages), wherever this runs from
    path = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent),
                                       os.environ.get("PYTHONPATH", "")) if p)  # fmt: skip
    env = {**os.environ, "PEPSI_DSN": dsn, "PYTHONPATH": path}
    argv = [sys.executable, "-m", "pepsi", "-c", str(conf), "dispatch", "serve"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while backlog_left(dsn) > backlog * 0.95:  # it has started
        if proc.poll() is not None:
            raise RuntimeError("the dispatcher did not start")
        time.sleep(0.05)
    return proc


def backlog_left(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pepsi.workqueue WHERE stage = 'backlog'")
        found = row.fetchone()
    return int(found[0]) if found else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--drain", type=int, metavar="BACKLOG", default=0,
        help="measure everything while a dispatcher drains a backlog of BACKLOG messages"
        " (and what is published): it must not run out before the end",
    )  # fmt: skip
    args = parser.parse_args()
    dsn = scratch_database("pepsi_bench_publish")
    raws, pubs = [], []
    left = None
    with tempfile.TemporaryDirectory() as tmp:
        conf = Path(tmp) / "pepsi.conf"
        conf.write_text(CONF + (DRAIN_CONF if args.drain else ""))
        dispatcher = draining(dsn, conf, args.drain) if args.drain else None
        try:
            for _ in range(max(1, args.reps)):
                raws.append(raw_inserts(dsn, args.messages))
                pubs.append(publishes(dsn, conf, args.messages))
            left = backlog_left(dsn) if dispatcher else None
        finally:
            if dispatcher is not None:
                dispatcher.terminate()
                dispatcher.wait(60)
    raw, pub = median(raws), median(pubs)
    results = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "reps": max(1, args.reps),
        "body_bytes": len(BODY),
        "raw_insert": raw,
        "publish": pub,
        "draining": {"backlog": args.drain, "left_at_the_end": left} if args.drain else None,
    }
    print(json.dumps(results, indent=2))
    commit_limit = raw["one_row_per_commit"]["per_s"]
    async_limit = raw["one_row_per_commit_async"]["per_s"]
    row_limit = raw["1000_rows_per_commit"]["per_s"]
    binary_limit = raw["1000_rows_per_commit_binary"]["per_s"]
    print(
        f"SUMMARY (median of {results['reps']}) raw: {commit_limit:.0f} commits/s "
        f"({async_limit:.0f} async), "
        f"{row_limit:.0f} rows/s batched ({binary_limit:.0f} with binary bytea); "
        f"publish single {pub['single']['per_s']:.0f}/s "
        f"({pub['single']['per_s'] / commit_limit:.2f}x commit limit), "
        f"async single {pub['async_single']['per_s']:.0f}/s "
        f"({pub['async_single']['per_s'] / commit_limit:.2f}x; "
        f"{pub['async_single']['per_s'] / async_limit:.2f}x async commit limit), "
        f"batch 100 {pub['batch_100']['per_s']:.0f}/s, "
        f"batch 1000 {pub['batch_1000']['per_s']:.0f}/s "
        f"({pub['batch_1000']['per_s'] / row_limit:.2f}x row limit, "
        f"{pub['batch_1000']['per_s'] / binary_limit:.2f}x binary), "
        f"async pipelined {pub['async_pipelined']['per_s']:.0f}/s"
    )

    def cpu(cell: dict[str, Any]) -> str:
        return f"{cell['client_cpu_us']:g}+{cell.get('backend_cpu_us', '?')}"

    print(
        "CPU µs a message, client + its backends (the run with the median rate): raw "
        f"{cpu(raw['one_row_per_commit'])}, raw async {cpu(raw['one_row_per_commit_async'])}, "
        f"publish {cpu(pub['single'])}, async "
        f"{cpu(pub['async_single'])}; raw 1000 binary {cpu(raw['1000_rows_per_commit_binary'])}, "
        f"publish_many 1000 {cpu(pub['batch_1000'])}"
    )
    if args.drain:
        ran_out = " (ran out: raise --drain)" if not left else ""
        print(f"measured while a dispatcher drained {args.drain} messages; {left} left{ran_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
