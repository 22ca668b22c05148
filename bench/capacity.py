"""What one PostgreSQL primary carries: messages per PostgreSQL core, rows and WAL per message.

    PEPSI_DSN=$(.venv/bin/pepsi db url) .venv/bin/python bench/capacity.py [--reps 3]
        [--only W,...] [--messages 20000] [--publish-one 3000] [--publish-batch 30000]
        [--body-bytes 1024] [--checkpoint] [--config TEXT] [--compare TEXT] [--json FILE]

The numbers a capacity plan needs (docs/scaling.md), on the embedded server
(or $PEPSI_DSN's), each workload in a scratch database of its own, Pepsi's
DEFAULT configuration (a pepsi.conf with only HANDLER and NEXT), no-op
handlers, every message with a body of --body-bytes. Reps are interleaved
(workload A B C D, A B C D, ...); each cell is the median (min–max) over reps.

  publish_one   confirmed publishes, one per call (no dispatcher running)
  publish_100   confirmed publishes, publish_many of 100 per call
  drain1        1 stage, end to end: N messages published in batches of 1 000
                into a warm pipeline, the clock stopped when the queue is empty
                (so publish, claim, the worker's pass and the delete all count)
  drain3        the same through 3 stages s1 -> s2 -> s3
  backlog1      (only when named in --only) 1 stage: N messages published
                while the dispatcher is stopped (SIGSTOP), then the clock runs
                from its SIGCONT until the queue is empty; with --checkpoint,
                the checkpoint falls between the two: a backlog present at a
                checkpoint, the case that writes full-page images

For each run:
- msg/s;
- CPU by side, from /proc (psutil: utime + stime, reaped children included)
  before/after: PostgreSQL = the postmaster and every process under it (the
  whole server: another user's load on it counts too, see "other dbs"), Pepsi
  = this process (the publisher) + the dispatcher + its workers. From that,
  "msg/s per PostgreSQL core" = messages per CPU-second of the server;
- writes: tuples inserted / updated / deleted in the `pepsi` schema
  (pg_stat_user_tables of the scratch database), commits of the scratch
  database, WAL bytes (pg_current_wal_lsn difference: cluster-wide), full-page
  images (pg_stat_wal), WAL fsyncs (pg_stat_io, PostgreSQL 18) and
  checkpoints during the run, all per message. WAL bytes are read 1.5 s after
  the run, the statistics 11 s after it: a backend that went idle less than
  1 s after its last flush reports the rest only 10 s later. (The warm-up's
  200 messages may still be unflushed when the run starts and count in it:
  1 % of a 20 000-message drain at most.)
- "other dbs": commits in the server's other databases during the run, and
  "other load": cores the machine spent on anything else (a disturbed run).

--checkpoint runs CHECKPOINT just before each measured run: the WAL then
carries a full-page image of every page a run touches first (the worst case;
the default's short runs usually see no checkpoint and no image at all). So
that a run reuses pages as a queue in service does, the queue is then emptied
between runs by DELETE and VACUUM instead of TRUNCATE (pages written fresh
after a checkpoint need no image); the first rep starts on a fresh table.
--config adds sections to every pepsi.conf; --compare runs every workload a
second time, right after the first in each rep, with more sections (rows
"W +"): a setting against the defaults, interleaved so that the machine's
drift hits both.

Prints one JSON document (also to --json FILE), a markdown table and a
SUMMARY line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from race import fmt, log, on_sigterm, spread, timed_run
from race_peers import (
    BODY,
    Pepsi,
    Shared,
    StampSocket,
    chunks,
    drop_database,
    postmaster_pid,
    server_dsn,
)

from pepsi.publishing import OutgoingMessage

WORKLOADS = ("publish_one", "publish_100", "drain1", "drain3", "backlog1")
DEFAULT_WORKLOADS = WORKLOADS[:4]  # backlog1 only when named in --only
# An idle backend flushes its pending statistics at once, unless it flushed
# less than 1 s before: then only after 10 s (PGSTAT_IDLE_INTERVAL).
STATS_FLUSH = 11.0
SETTLE = 1.5  # after a run: the dispatcher's idle statistics flush, before WAL is read
PUBLISH_BATCH = 100
DRAIN_BATCH = 1000

# Cumulative counters read before and after each run; a counter the server
# does not have (an older PostgreSQL) reads as None and is left out.
COUNTERS: dict[str, LiteralString] = {
    "ins": "SELECT sum(n_tup_ins) FROM pg_stat_user_tables WHERE schemaname = 'pepsi'",
    "upd": "SELECT sum(n_tup_upd) FROM pg_stat_user_tables WHERE schemaname = 'pepsi'",
    "hot_upd": "SELECT sum(n_tup_hot_upd) FROM pg_stat_user_tables WHERE schemaname = 'pepsi'",
    "del": "SELECT sum(n_tup_del) FROM pg_stat_user_tables WHERE schemaname = 'pepsi'",
    "commits": "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    "other_db_commits": "SELECT sum(xact_commit) FROM pg_stat_database"
    " WHERE datname IS DISTINCT FROM current_database()",
    "wal_bytes": "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn",
    "wal_fpi": "SELECT wal_fpi FROM pg_stat_wal",
    "wal_fsyncs": "SELECT sum(fsyncs) FROM pg_stat_io WHERE object = 'wal'",
    "checkpoints": "SELECT num_timed + num_requested FROM pg_stat_checkpointer",
}
SERVER_SETTINGS = (
    "server_version",
    "shared_buffers",
    "synchronous_commit",
    "wal_level",
    "full_page_writes",
    "wal_compression",
    "wal_sync_method",
    "checkpoint_timeout",
    "max_wal_size",
)


def counters(db: psycopg.Connection[Any]) -> dict[str, float | None]:
    found: dict[str, float | None] = {}
    for name, text in COUNTERS.items():
        try:
            row = db.execute(text).fetchone()
        except psycopg.Error:  # not on this server version
            found[name] = None
            continue
        found[name] = float(row[0]) if row and row[0] is not None else 0.0
    return found


def per_message(
    before: dict[str, float | None], after: dict[str, float | None], n: int
) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, end in after.items():
        start = before.get(name)
        if end is None or start is None:
            continue
        delta = end - start
        # whole counts for what disturbs a run, per message for the rest
        out[name] = delta if name in {"other_db_commits", "checkpoints"} else delta / n
    return out


# -- the workloads -------------------------------------------------------------


def publish_single(c: Pepsi, body: bytes | None) -> Callable[[int], float]:
    def run(n: int) -> float:
        assert c.publisher is not None
        start = time.perf_counter()
        for _ in range(n):
            c.publisher.publish(c.first, body)
        return time.perf_counter() - start

    return run


def publish_batches(c: Pepsi, size: int, body: bytes | None) -> Callable[[int], float]:
    def run(n: int) -> float:
        assert c.publisher is not None
        batch = [OutgoingMessage(c.first, body)] * size
        start = time.perf_counter()
        for _ in range(n // size):
            c.publisher.publish_many(batch)
        return time.perf_counter() - start

    return run


def drain(c: Pepsi, body: bytes | None) -> Callable[[int], float]:
    """Race's drain, with bodies: batches of 1 000 into the warm pipeline, until empty."""

    def run(n: int) -> float:
        assert c.publisher is not None
        batches = list(chunks([OutgoingMessage(c.first, body)] * n, DRAIN_BATCH))
        start = time.perf_counter()
        for batch in batches:
            c.publisher.publish_many(batch)
        c.wait(n)
        return time.perf_counter() - start

    return run


def backlog(c: Pepsi, body: bytes | None, n: int) -> None:
    """Publish n messages while the dispatcher is stopped (SIGSTOP): a backlog."""
    assert c.publisher is not None
    os.kill(c.procs[0].pid, signal.SIGSTOP)
    try:
        for batch in chunks([OutgoingMessage(c.first, body)] * n, DRAIN_BATCH):
            c.publisher.publish_many(batch)
    except BaseException:
        os.kill(c.procs[0].pid, signal.SIGCONT)
        raise


def resume(c: Pepsi) -> Callable[[int], float]:
    """Let the stopped dispatcher go (SIGCONT) and time the backlog's drain."""

    def run(n: int) -> float:
        start = time.perf_counter()
        os.kill(c.procs[0].pid, signal.SIGCONT)
        c.wait(n)
        return time.perf_counter() - start

    return run


def lineup(
    shared: Shared, workloads: list[str], extra: str, compare: str
) -> list[tuple[str, str, Pepsi]]:
    """(label, workload, contestant) in the order each rep runs them.

    Each workload runs with `extra` and, given `compare`, right after it with
    `compare` added (label "W +"). The publishes of one configuration share one
    contestant, which runs no dispatcher."""
    variants = [("", extra)] + ([(" +", f"{extra}\n{compare}")] if compare.strip() else [])
    publishers: dict[str, Pepsi] = {}
    out = []
    for w in workloads:
        for mark, text in variants:
            head = text.strip() + "\n" if text.strip() else ""
            if w.startswith("publish"):
                c = publishers.get(mark) or Pepsi(
                    shared, f"capacity publish{mark.strip() and ' compare'}",
                    head + Pepsi.config_text(),
                )  # fmt: skip
                publishers[mark] = c
            else:
                stages = 3 if w == "drain3" else 1  # drain1 and backlog1: one stage
                label = f"capacity {w}{mark.strip() and ' compare'}"
                c = Pepsi(shared, label, head + Pepsi.config_text(stages=stages))
            out.append((w + mark, w, c))
    return out


def sizes(args: argparse.Namespace) -> dict[str, int]:
    batch = max(PUBLISH_BATCH, args.publish_batch // PUBLISH_BATCH * PUBLISH_BATCH)
    return {
        "publish_one": args.publish_one,
        "publish_100": batch,
        "drain1": args.messages,
        "backlog1": args.messages,
        "drain3": args.messages,
    }


def one_run(
    workload: str, c: Pepsi, n: int, body: bytes | None, pm: int | None, *, checkpoint: bool
) -> dict[str, Any]:
    """One measured run: rate and CPU (race's timed_run), then the database's counters."""
    assert c.db is not None
    runs: dict[str, Callable[[int], float]] = {
        "publish_one": publish_single(c, body),
        "publish_100": publish_batches(c, PUBLISH_BATCH, body),
        "drain1": drain(c, body),
        "drain3": drain(c, body),
        "backlog1": resume(c),
    }
    # a backlog is at the checkpoint by construction: TRUNCATE is fine for it
    reuse = checkpoint and workload != "backlog1"
    empty(c, reuse=reuse)
    time.sleep(STATS_FLUSH)  # what came before is in the statistics
    c.warm()  # drains: every worker of the pool started (idle ones stop after 5 s)
    if workload == "backlog1":  # published before the clock, its statistics flushed
        backlog(c, body, n)
        time.sleep(STATS_FLUSH)
    if checkpoint:  # the worst case for WAL: every page's first change is a full image
        c.db.execute("CHECKPOINT")
    before = counters(c.db)
    result = timed_run(c, runs[workload], n, pm)
    time.sleep(SETTLE)
    wal = counters(c.db)["wal_bytes"]  # the server's own position: no flush needed
    time.sleep(STATS_FLUSH - SETTLE)
    after = {**counters(c.db), "wal_bytes": wal}
    result["db_per_msg"] = per_message(before, after, n)
    empty(c, reuse=reuse)
    return result


def empty(c: Pepsi, *, reuse: bool) -> None:
    """An empty queue for the next run: TRUNCATE, or with `reuse` DELETE and VACUUM.

    After a TRUNCATE every page a run writes is new, and a new page needs no
    full-page image after a checkpoint; a queue in service reuses the pages its
    vacuum freed, and those do. `reuse` keeps them, for --checkpoint."""
    assert c.db is not None
    if not reuse:
        c.reset()
        return
    c.db.execute("DELETE FROM pepsi.workqueue")
    c.db.execute("VACUUM pepsi.workqueue, pepsi.workqueue_body")


# -- summary and report ---------------------------------------------------------


def derived(run: dict[str, Any]) -> dict[str, float]:
    """The planner's numbers of one run."""
    cpu = run["cpu_ms_per_1k"]  # ms per 1 000 messages = µs per message
    pepsi_us = cpu["total"] - cpu.get("postgres", 0.0)
    db = run["db_per_msg"]
    out = {
        "per_s": run["per_s"],
        "pg_us_per_msg": cpu.get("postgres", 0.0),
        "pepsi_us_per_msg": pepsi_us,
        "msgs_per_pg_core_s": 1e6 / cpu["postgres"] if cpu.get("postgres") else 0.0,
        "msgs_per_pepsi_core_s": 1e6 / pepsi_us if pepsi_us else 0.0,
        "pg_cores": run["core_share"].get("postgres", 0.0),
        "pepsi_cores": run["core_share"]["total"] - run["core_share"].get("postgres", 0.0),
        "other_load_cores": run["other_load_cores"],
    }
    for name, value in db.items():
        out[name] = value
    out["tuples_written"] = db.get("ins", 0.0) + db.get("upd", 0.0) + db.get("del", 0.0)
    return out


def summarize(reps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    rows = [derived(r) for r in reps]
    keys = [k for k in rows[0] if all(k in r for r in rows)]
    return {k: spread([round(r[k], 3) for r in rows]) for k in keys}


def rng(cell: dict[str, dict[str, float]], key: str, digits: int = 0) -> str:
    s = cell.get(key)
    if s is None:
        return "–"
    return f"{fmt(s['median'], digits)} ({fmt(s['min'], digits)}–{fmt(s['max'], digits)})"


def med(cell: dict[str, dict[str, float]], key: str, digits: int = 0) -> str:
    s = cell.get(key)
    return "–" if s is None else fmt(s["median"], digits)


def markdown(results: dict[str, Any]) -> str:
    m, cells = results["machine"], results["workloads"]
    out = [
        f"Capacity, {results['settings']['date']}: {m['cpus']} cores, PostgreSQL"
        f" {m['postgres']['server_version']}, Python {m['python']},"
        f" {results['settings']['reps']} interleaved reps, median (min–max);"
        f" bodies of {results['settings']['body_bytes']} bytes"
        + (
            ", a CHECKPOINT before each run."
            if results["settings"]["checkpoint_before_each_run"]
            else "."
        ),
        "",
        "| workload | msg/s | PostgreSQL µs CPU/msg | msg/s per PostgreSQL core"
        " | Pepsi µs CPU/msg | msg/s per Pepsi core | PG cores busy | other load |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, cell in cells.items():
        out.append(
            f"| {name} | {rng(cell, 'per_s')} | {rng(cell, 'pg_us_per_msg')}"
            f" | {rng(cell, 'msgs_per_pg_core_s')} | {rng(cell, 'pepsi_us_per_msg')}"
            f" | {rng(cell, 'msgs_per_pepsi_core_s')} | {med(cell, 'pg_cores', 2)}"
            f" | {med(cell, 'other_load_cores', 2)} |"
        )
    out += [
        "",
        "Per message (medians): tuples written in the `pepsi` schema, commits, WAL.",
        "",
        "| workload | inserted | updated (HOT) | deleted | commits | WAL bytes"
        " | full-page images | WAL fsyncs | checkpoints | other dbs' commits |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, cell in cells.items():
        out.append(
            f"| {name} | {med(cell, 'ins', 2)} | {med(cell, 'upd', 2)}"
            f" ({med(cell, 'hot_upd', 2)}) | {med(cell, 'del', 2)} | {med(cell, 'commits', 3)}"
            f" | {rng(cell, 'wal_bytes')} | {med(cell, 'wal_fpi', 3)}"
            f" | {med(cell, 'wal_fsyncs', 3)} | {med(cell, 'checkpoints')}"
            f" | {med(cell, 'other_db_commits')} |"
        )
    return "\n".join(out)


def summary(results: dict[str, Any]) -> str:
    parts = []
    for name, cell in results["workloads"].items():
        if "per_s" not in cell:
            continue
        parts.append(
            f"{name} {fmt(cell['per_s']['median'])} msg/s,"
            f" {fmt(cell['msgs_per_pg_core_s']['median'])} per PG core,"
            f" {fmt(cell.get('wal_bytes', {}).get('median'))} WAL B/msg"
        )
    return "SUMMARY " + "; ".join(parts)


# -- main -------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--reps", type=int, default=3, help="interleaved reps (default 3)")
    add("--only", metavar="W[,W...]", help=f"a subset of {','.join(WORKLOADS)}")
    add("--messages", type=int, default=20_000, help="drain size (default 20 000)")
    add("--publish-one", type=int, default=3000, help="single publishes (default 3 000)")
    add("--publish-batch", type=int, default=30_000, help="batched, 100 a call (default 30 000)")
    add(
        "--body-bytes",
        type=int,
        default=len(BODY),
        help="body of every message (default 1024; 0: none)",
    )
    add(
        "--checkpoint", action="store_true",
        help="CHECKPOINT just before each run (needs superuser or pg_checkpoint), the queue"
        " emptied by DELETE + VACUUM, not TRUNCATE: WAL with the most full-page images",
    )  # fmt: skip
    add(
        "--config", default="", metavar="TEXT",
        help="sections put before the stages of every pepsi.conf (default: none, the defaults),"
        " e.g. $'[pepsi-postgres]\\nWORKER_SYNCHRONOUS_COMMIT = yes'",
    )  # fmt: skip
    add(
        "--compare", default="", metavar="TEXT",
        help="also run each workload with these sections added, right after it in every"
        " rep (rows 'W +'): a setting against the defaults, interleaved",
    )  # fmt: skip
    add("--json", type=Path, metavar="FILE", help="also write the JSON here")
    args = parser.parse_args(argv)
    chosen = args.only.split(",") if args.only else DEFAULT_WORKLOADS
    args.workloads = [w for w in WORKLOADS if w in chosen]
    unknown = set((args.only or "").split(",")) - set(WORKLOADS) - {""}
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    return args


def server_settings(dsn: str) -> dict[str, str]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, current_setting(name) FROM pg_settings WHERE name = ANY(%s)",
            (list(SERVER_SETTINGS),),
        ).fetchall()
    return {str(k): str(v) for k, v in rows}


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, on_sigterm)  # stop the dispatchers, drop the databases
    args = parse_args(argv)
    body = b"x" * args.body_bytes if args.body_bytes else None  # 0: no body row at all
    dsn = server_dsn()
    pm = postmaster_pid(dsn)
    if pm is None:
        log("warning: postmaster.pid not readable: no PostgreSQL CPU (run on the server's host)")
    n = sizes(args)
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "postgres": server_settings(dsn),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        },
        "settings": {
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "reps": args.reps,
            "sizes": {w: n[w] for w in args.workloads},
            "body_bytes": args.body_bytes,
            "checkpoint_before_each_run": args.checkpoint,
            "config": args.config,
            "compare": args.compare,
        },
        "workloads": {},
        "reps": {},
    }
    with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
        shared = Shared(Path(tmp), StampSocket(Path(tmp) / "stamps.sock"))
        runs = lineup(shared, args.workloads, args.config, args.compare)
        unique = list({id(c): c for _, _, c in runs}.values())
        try:
            for label, w, c in runs:
                results["reps"][label] = []
                if c.db is None:  # set up once (the publishes share one)
                    c.setup("publish_one" if w.startswith("publish") else "drain")
            for rep in range(args.reps):
                for label, w, c in runs:
                    run = one_run(w, c, n[w], body, pm, checkpoint=args.checkpoint)
                    results["reps"][label].append(run)
                    per_msg = run["db_per_msg"]
                    log(
                        f"rep {rep + 1} {label}: {run['per_s']:.0f}/s, PostgreSQL"
                        f" {run['cpu_ms_per_1k'].get('postgres', 0):.0f} µs/msg,"
                        f" WAL {per_msg.get('wal_bytes', 0):.0f} B/msg"
                    )
        finally:
            for c in unique:
                c.close()
                if c.dbname:
                    drop_database(c.dbname)
            shared.stamps.close()
    for w, reps in results["reps"].items():
        if reps:
            results["workloads"][w] = summarize(reps)
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(results, indent=2, ensure_ascii=False)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    print()
    print(markdown(results))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
