"""Fair scheduling: what it costs and what it buys.

    .venv/bin/python bench/fairness.py

On a scratch database `pepsi_bench_fair`, in one run:
- claim latency, fair vs FIFO, of one claim of 16 rows for stages whose
  backlog comes from 1, 10, 100 or 1 000 senders, with a 1 000-row and a
  200 000-row backlog per stage (the cost must stay flat): median of 30
  claims, each rolled back so the backlog is unchanged;
- messages/s through a 1-stage no-op pipeline fed by 100 senders, fair vs FIFO;
- how long a lone sender's message waits behind a 10 000-message burst of
  another sender, fair vs FIFO.
Prints one JSON document and a summary line.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from common import scratch_database
from pipeline import Run
from psycopg.types.json import Jsonb

from pepsi.db.queries import query
from pepsi.publishing import OutgoingMessage

SENDERS = (1, 10, 100, 1000)
BACKLOGS = (1000, 200_000)


def fill(conn: psycopg.Connection[Any], stage: str, rows: int, senders: int) -> None:
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, origin_user)"
        " SELECT %s, 'u' || (n %% %s) FROM generate_series(1, %s) n",
        (stage, senders, rows),
    )


def claim_ms(conn: psycopg.Connection[Any], stage: str, fair: bool) -> float:
    times = []
    for _ in range(30):
        with conn.transaction(force_rollback=True):
            start = time.perf_counter()
            if fair:
                conn.execute(
                    query("workqueue_claim_fair"),
                    {"stages": [stage], "caps": [16], "fifo": [1], "averages": [0.01],
                     "starts": [""], "lags": Jsonb({}), "max_senders": 64},
                ).fetchall()  # fmt: skip
            else:
                conn.execute(
                    query("workqueue_claim_fifo"), {"stages": [stage], "caps": [16]}
                ).fetchall()
            times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 3)


def claim_latency(dsn: str) -> list[dict[str, Any]]:
    results = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for backlog in BACKLOGS:
            for senders in SENDERS:
                fill(conn, f"b{backlog}-s{senders}", backlog, senders)
        conn.execute("VACUUM ANALYZE pepsi.workqueue")
        for backlog in BACKLOGS:
            for senders in SENDERS:
                stage = f"b{backlog}-s{senders}"
                results.append({
                    "backlog": backlog, "senders": senders,
                    "fair_ms": claim_ms(conn, stage, True),
                    "fifo_ms": claim_ms(conn, stage, False),
                })  # fmt: skip
        conn.execute("DELETE FROM pepsi.workqueue")
        conn.execute("VACUUM ANALYZE pepsi.workqueue")  # as autovacuum would, soon
    return results


def conf(fair: bool) -> str:
    return (
        f"[pepsi-dispatch]\nPOLL_INTERVAL = 5s\nWORKER_IDLE_TIMEOUT = 30s\n"
        f"FAIR_SCHEDULING = {'yes' if fair else 'no'}\n"
        "[stage-only]\nHANDLER = bench_stages:noop\nQUEUE_LIMIT = 16\n"
    )


def throughput(dsn: str, fair: bool, tmp: Path, messages: int = 5000) -> float:
    run = Run(dsn, conf(fair), tmp)
    try:
        run.warm("only")
        batch = [OutgoingMessage("only", origin_user=f"sender{i % 100}") for i in range(messages)]
        start = time.perf_counter()
        run.publisher.publish_many(batch)
        run.drain()
        return round(messages / (time.perf_counter() - start), 1)
    finally:
        run.close()


def lone_wait(dsn: str, fair: bool, tmp: Path, burst: int = 10_000) -> float:
    run = Run(dsn, conf(fair), tmp)
    try:
        run.warm("only")
        run.publisher.publish_many([OutgoingMessage("only", origin_user="bulk")] * burst)
        start = time.perf_counter()
        (lone,) = run.publisher.publish_many([OutgoingMessage("only", origin_user="alice")])
        while run.db.execute(
            "SELECT 1 FROM pepsi.workqueue WHERE workqueue_id = %s", (lone,)
        ).fetchone():
            time.sleep(0.002)
        waited = time.perf_counter() - start
        run.drain()
        return round(waited * 1000, 1)
    finally:
        run.close()


def main() -> int:
    dsn = scratch_database("pepsi_bench_fair")
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "machine": {"cpus": os.cpu_count()},
            "claim_latency": claim_latency(dsn),
            "throughput_100_senders": {
                "fair_msg_s": throughput(dsn, True, Path(tmp)),
                "fifo_msg_s": throughput(dsn, False, Path(tmp)),
            },
            "lone_message_behind_10k_burst_ms": {
                "fair": lone_wait(dsn, True, Path(tmp)),
                "fifo": lone_wait(dsn, False, Path(tmp)),
            },
        }
    print(json.dumps(results, indent=2))
    lat = {(r["backlog"], r["senders"]): r for r in results["claim_latency"]}
    small, big = lat[(1000, 100)], lat[(200_000, 100)]
    tp = results["throughput_100_senders"]
    lone = results["lone_message_behind_10k_burst_ms"]
    print(
        f"SUMMARY claim (100 senders) fair {small['fair_ms']} ms at 1k backlog vs "
        f"{big['fair_ms']} ms at 200k ({big['fair_ms'] / small['fair_ms']:.2f}x); "
        f"fair/FIFO claim {big['fair_ms'] / big['fifo_ms']:.1f}x; throughput fair "
        f"{tp['fair_msg_s']:.0f} vs FIFO {tp['fifo_msg_s']:.0f} msg/s "
        f"({tp['fair_msg_s'] / tp['fifo_msg_s']:.2f}x); lone message behind 10k: "
        f"fair {lone['fair']:.0f} ms vs FIFO {lone['fifo']:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
