"""What storing a body costs the server, compressed (pglz) or as it is.

    .venv/bin/python bench/bodies.py [--rows 2000] [--reps 3]

PostgreSQL compresses a value over about 2 KB unless its column says
`STORAGE EXTERNAL`; Pepsi's header blocks and bodies are stored that way
since schema 30. On a scratch database, two copies of `pepsi.workqueue_body`,
one per storage mode; for each kind of body, --rows rows inserted 100 a
statement (as `publish_many` does), then read back 10 a statement (as a
worker's load does). The backend's CPU from /proc (so the server must run on
this machine) per row, the median of --reps alternating reps, and the room a
row takes. Prints one JSON document and a summary.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import statistics
from typing import Any

import psycopg
from common import process_cpu, scratch_database

MODES = {"compressed": "EXTENDED", "plain": "EXTERNAL"}
WORDS = [
    "the", "mail", "queue", "message", "delivery", "status", "report", "retry", "sender",
    "recipient", "server", "invoice", "meeting", "attached", "please", "regards", "thanks",
]  # fmt: skip


def text(size: int, rng: random.Random) -> bytes:
    """Prose-like lines of 72 characters: how a text part compresses (2-3 times)."""
    lines, length = [], 0
    while length < size:
        line = " ".join(f"{rng.choice(WORDS)}{rng.randint(0, 99)}" for _ in range(9))[:72]
        lines.append(line)
        length += len(line) + 2
    return "\r\n".join(lines).encode()[:size]


def bodies() -> dict[str, bytes]:
    rng = random.Random(36)  # noqa: S311  # the same bodies every run, not a secret
    return {
        "text 10 KB": text(10 * 1024, rng),
        "text 50 KB": text(50 * 1024, rng),
        "one byte repeated, 10 KB (bench/amqp.py's)": b"x" * 10 * 1024,
        "base64 attachment 100 KB": base64.encodebytes(rng.randbytes(75 * 1024))[: 100 * 1024],
        "text 1 KB (under the threshold)": text(1024, rng),
    }


def one_rep(conn: psycopg.Connection[Any], table: str, body: bytes, rows: int) -> dict[str, float]:
    pid = conn.info.backend_pid
    conn.execute(f"TRUNCATE {table}")
    before = process_cpu(pid)
    with conn.cursor() as cur:
        for _ in range(0, rows, 100):
            cur.executemany(
                f"INSERT INTO {table} (header, body) VALUES (%s, %s)", [(b"", body)] * 100
            )
    inserted = process_cpu(pid)
    ids = [row[0] for row in conn.execute(f"SELECT body_id FROM {table}").fetchall()]
    loaded = process_cpu(pid)
    load = f"SELECT header, body FROM {table} WHERE body_id = ANY(%s)"
    for i in range(0, len(ids), 10):
        conn.execute(load, (ids[i : i + 10],)).fetchall()
    done = process_cpu(pid)
    size = conn.execute("SELECT pg_total_relation_size(%s)", (table,)).fetchone()
    assert size is not None
    for i in range(0, len(ids), 10):
        conn.execute(f"DELETE FROM {table} WHERE body_id = ANY(%s)", (ids[i : i + 10],))
    deleted = process_cpu(pid)
    return {
        "insert_us": (inserted - before) / rows * 1e6,
        "load_us": (done - loaded) / rows * 1e6,
        "delete_us": (deleted - done) / rows * 1e6,
        "kb_per_row": int(str(size[0])) / rows / 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dsn = scratch_database("pepsi_bench_bodies")
    results: dict[str, dict[str, dict[str, float]]] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        shipped = conn.execute(
            "SELECT string_agg(attname || ' ' || attstorage::text, ', ' ORDER BY attname)"
            " FROM pg_attribute WHERE attrelid = 'pepsi.workqueue_body'::regclass"
            " AND attname IN ('header', 'body')"
        ).fetchone()
        for mode, storage in MODES.items():
            conn.execute(f"CREATE TABLE bench_{mode} (LIKE pepsi.workqueue_body INCLUDING ALL)")
            conn.execute(
                f"ALTER TABLE bench_{mode} ALTER COLUMN header SET STORAGE {storage},"
                f" ALTER COLUMN body SET STORAGE {storage}"
            )
        for kind, body in bodies().items():
            reps: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
            for rep in range(args.reps):
                for mode in MODES if rep % 2 == 0 else reversed(MODES):
                    reps[mode].append(one_rep(conn, f"bench_{mode}", body, args.rows))
            results[kind] = {
                mode: {key: round(statistics.median(r[key] for r in runs), 1) for key in runs[0]}
                for mode, runs in reps.items()
            }
    print(json.dumps({"rows": args.rows, "reps": args.reps, "shipped": shipped and shipped[0],
                      "results": results}, indent=2))  # fmt: skip
    for kind, modes in results.items():
        c, p = modes["compressed"], modes["plain"]
        print(
            f"SUMMARY {kind}: insert {c['insert_us']:.0f} → {p['insert_us']:.0f} µs,"
            f" load {c['load_us']:.0f} → {p['load_us']:.0f} µs,"
            f" delete {c['delete_us']:.0f} → {p['delete_us']:.0f} µs,"
            f" {c['kb_per_row']:.1f} → {p['kb_per_row']:.1f} KB a row (compressed → plain)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
