"""What operating Pepsi costs the database: `queue status`, `pepsi top`, a stats flush.

    .venv/bin/python bench/operations.py

On a scratch database `pepsi_bench_ops`, for a queue of 10 k, 100 k and 1 M
rows (four stages, 90 % pending, 5 % paused, 5 % failed): the median time of
7 runs of each query `pepsi queue status` runs, of one `pepsi top` refresh
(its whole read, and without the queue count that a slow count skips), and
of the dispatcher's statistics flush for 10 stages.
Prints one JSON document and a summary line.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg
from common import scratch_database

from pepsi.admin.watch.activity import count_queue, read_sample
from pepsi.db.queries import query
from pepsi.dispatch.stats import Stats

SIZES = (10_000, 100_000, 1_000_000)
STAGES = ["validate", "price", "route", "ship"]
RUNS = 7


def fill(conn: psycopg.Connection[Any], rows: int) -> None:
    conn.execute("TRUNCATE pepsi.workqueue CASCADE")
    conn.execute(
        "INSERT INTO pepsi.workqueue (stage, status, timeout, state, sender)"
        " SELECT (%(stages)s::text[])[1 + n %% 4],"
        "        CASE WHEN n %% 20 = 0 THEN 'paused' WHEN n %% 20 = 1 THEN 'failed'"
        "             ELSE 'pending' END::pepsi.workqueue_status,"
        "        CASE WHEN n %% 20 = 0 THEN now() + interval '1 hour' END,"
        '        CASE WHEN n %% 20 = 1 THEN \'{"failure_class": "permanent"}\'::jsonb'
        "             ELSE '{}'::jsonb END,"
        "        'a@b.c'"
        " FROM generate_series(1, %(rows)s) AS n",
        {"stages": STAGES, "rows": rows},
    )
    conn.execute("VACUUM ANALYZE pepsi.workqueue")


def median_ms(action: Callable[[], object]) -> float:
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        action()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 2)


def flush_params() -> dict[str, Any]:
    stats = Stats()
    for n in range(10):
        stats.stage(f"stage-{n}", "processed", 100)
        stats.stage(f"stage-{n}", "busy_us", 123_456)
    stats.count("claims", 40)
    return stats.take()


def main() -> None:
    dsn = scratch_database("pepsi_bench_ops")
    results: dict[str, Any] = {}
    flush = {**flush_params(), "started": None}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for rows in SIZES:
            fill(conn, rows)

            def run(name: str, params: dict[str, Any] | None = None) -> Callable[[], object]:
                return lambda: conn.execute(query(name), params).fetchall()

            results[str(rows)] = {
                "count_by_stage_status_ms": median_ms(run("workqueue_count_by_stage_status")),
                "heads_by_stage_ms": median_ms(run("workqueue_heads_by_stage", {"stages": STAGES})),
                "failures_by_class_ms": median_ms(run("workqueue_count_failures_by_class")),
                "top_refresh_ms": median_ms(lambda: read_sample(conn, count_queue(conn).counts)),
                "top_refresh_without_count_ms": median_ms(lambda: read_sample(conn, {})),
                "stats_flush_ms": median_ms(lambda: conn.execute(query("stats_flush"), flush)),
            }
    print(json.dumps(results, indent=2))
    big = results[str(SIZES[-1])]
    print(
        f"1 M rows: queue status counts {big['count_by_stage_status_ms']} ms, "
        f"top refresh {big['top_refresh_ms']} ms, stats flush {big['stats_flush_ms']} ms"
    )


if __name__ == "__main__":
    main()
