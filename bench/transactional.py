"""What a transactional stage costs (issue 18): msg/s, transactional vs plain, one run.

    .venv/bin/python bench/transactional.py [--messages 10000] [--reps 3]

One metadata-only Python stage (batched: QUEUE_LIMIT ids per batch, 4
workers) that inserts one row per message into an application table:

- plain: through its own connection (autocommit, `synchronous_commit = off`
  as the worker's own): the insert commits at once, the outcomes of the
  batch are written afterwards in one statement (at-least-once);
- transactional: `@stage(transactional=True)`, through `msg.db`: BEGIN, the
  insert, the guarded outcome, COMMIT, per message (exactly once);
- none: the same stage without the insert (the pipeline's own cost).

Reps interleaved; msg/s from the commit of a burst to the last message done
(pipeline warmed first). Prints one JSON document and a summary line. The
stage functions live in this module (the workers import it as `transactional`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

from pepsi import Message, stage

DB = "pepsi_bench_transactional"
INSERT = "INSERT INTO bench_effects (workqueue_id, stage) VALUES (%s, %s)"
_own: list[psycopg.Connection[Any]] = []


@stage(transactional=True)
def tx_insert(msg: Message) -> None:
    msg.db.execute(INSERT, (msg.id, msg.stage))


@stage()
def plain_insert(msg: Message) -> None:
    if not _own:
        conn = psycopg.connect(os.environ["PEPSI_DSN"], autocommit=True)
        conn.execute("SET synchronous_commit = off")
        _own.append(conn)
    _own[0].execute(INSERT, (msg.id, msg.stage))


@stage()
def none(msg: Message) -> None:
    return None


MODES = {"transactional": "tx_insert", "plain": "plain_insert", "none": "none"}


def conf(func: str) -> str:
    return f"[stage-work]\nHANDLER = transactional:{func}\nPARALLELISM = 4\nQUEUE_LIMIT = 64\n"


def once(dsn: str, mode: str, messages: int, tmp: Path) -> dict[str, float]:
    from pipeline import Run  # noqa: PLC0415  # the workers import this module without it

    run = Run(dsn, conf(MODES[mode]), tmp)
    try:
        run.warm("work")
        run.db.execute("TRUNCATE bench_effects")
        start = time.perf_counter()
        run.publish("work", messages)
        run.drain()
        elapsed = time.perf_counter() - start
        row = run.db.execute("SELECT count(*) FROM bench_effects").fetchone()
        written = int(row[0]) if row else 0
    finally:
        run.close()
    if mode != "none" and written < messages:
        raise RuntimeError(f"{mode}: {written} rows for {messages} messages")
    return {"messages_per_s": round(messages / elapsed, 1), "seconds": round(elapsed, 3)}


def main() -> int:
    from common import scratch_database  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=10000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dsn = scratch_database(DB)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_effects (workqueue_id bigint, stage text)")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):  # interleaved: the machine's drift hits every mode
            for mode in MODES:
                results[mode].append(once(dsn, mode, args.messages, Path(tmp)))
    median = {
        mode: statistics.median(r["messages_per_s"] for r in reps) for mode, reps in results.items()
    }
    print(json.dumps({"messages": args.messages, "runs": results, "median": median}, indent=2))
    print(
        f"SUMMARY one batched stage inserting a row per message, {args.messages} messages:"
        f" transactional {median['transactional']:.0f} msg/s, plain {median['plain']:.0f}"
        f" msg/s (x{median['transactional'] / median['plain']:.2f}), no insert"
        f" {median['none']:.0f} msg/s"
    )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
