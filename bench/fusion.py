"""What stage fusion saves (W-10): a 4-stage metadata-only chain, fused and not, one run.

    .venv/bin/python bench/fusion.py [--messages 10000] [--reps 3]

Four `set` built-in stages (no Python handler; built-ins fuse by default) in
the default configuration, once with `[pepsi] ALLOW_FUSION = yes` (the
default) and once with `no`, reps interleaved. For each: msg/s from the
commit of a burst to the last message done (the pipeline warmed first), and
commits per message (pg_stat_database.xact_commit of the scratch database
over the run: every session's, the dispatcher's claims and the workers'
writes). Prints one JSON document and a summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import scratch_database
from pipeline import Run

DB = "pepsi_bench_fusion"
CHAIN = ["s1", "s2", "s3", "s4"]


def chain(fusion: bool) -> str:
    text = f"[pepsi]\nALLOW_FUSION = {'yes' if fusion else 'no'}\n"
    for i, name in enumerate(CHAIN):
        text += f"[stage-{name}]\nPROGRAM = pepsi-stage-set\nSET = {name}=1\n"
        if i + 1 < len(CHAIN):
            text += f"NEXT = {CHAIN[i + 1]}\n"
    return text


def commits(run: Run) -> int:
    row = run.db.execute(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    return int(row[0]) if row else 0


def once(dsn: str, fusion: bool, messages: int, tmp: Path) -> dict[str, float]:
    run = Run(dsn, chain(fusion), tmp)
    try:
        run.warm(CHAIN[0])
        time.sleep(0.6)  # statistics of the warm-up reach pg_stat_database
        before = commits(run)
        start = time.perf_counter()
        run.publish(CHAIN[0], messages)
        run.drain()
        elapsed = time.perf_counter() - start
        time.sleep(0.6)
        after = commits(run)
    finally:
        run.close()
    return {
        "messages_per_s": round(messages / elapsed, 1),
        "commits_per_message": round((after - before) / messages, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=10000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    dsn = scratch_database(DB)
    results: dict[str, list[dict[str, float]]] = {"fused": [], "not_fused": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):  # interleaved: the machine's drift hits both
            results["fused"].append(once(dsn, True, args.messages, Path(tmp)))
            results["not_fused"].append(once(dsn, False, args.messages, Path(tmp)))
    summary = {
        name: {
            key: statistics.median(r[key] for r in reps)
            for key in ("messages_per_s", "commits_per_message")
        }
        for name, reps in results.items()
    }
    print(json.dumps({"runs": results, "median": summary}, indent=2))
    fused, plain = summary["fused"], summary["not_fused"]
    print(
        f"SUMMARY 4-stage metadata chain: fused {fused['messages_per_s']:.0f} msg/s,"
        f" {fused['commits_per_message']:.2f} commits/msg; not fused"
        f" {plain['messages_per_s']:.0f} msg/s, {plain['commits_per_message']:.2f} commits/msg;"
        f" x{fused['messages_per_s'] / plain['messages_per_s']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
