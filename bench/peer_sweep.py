"""Each peer of bench/race.py over its settings: which one drains fastest?

    .venv/bin/pip install -e '.[dev,bench]'      # pgqueuer, procrastinate, pika, psutil
    .venv/bin/python bench/peer_sweep.py --peer pgqueuer|procrastinate|rabbitmq
                     [--only drain,drain_preloaded] [--messages N] [--reps 3] [--json FILE]

The two drains of bench/race.py, the same workloads as Pepsi's: `drain` (N messages
published in batches of 1 000 while warm consumers drain them) and `drain_preloaded` (N
enqueued first in one transaction, the clock from its commit; RabbitMQ: published and
confirmed first, the consumers held back until go). Two phases:

1. a grid over the knobs pgqueuer's, procrastinate's and RabbitMQ's documentation name
   for throughput: pgqueuer consumer processes (1, 2, 4) × batch_size (10, 25, 50, 100,
   250, 500, 1 000); procrastinate worker concurrency (1, 4, 10, 30) × processes (1, 2); RabbitMQ
   consumers (1, 2) × prefetch (100, 300, 1 000) on a quorum queue;
2. at the grid's best point (the highest median of the first workload of --only), each
   further documented knob alone: pgqueuer several PgQueuer instances in one process (its
   benchmark tool's layout), drain mode (its tool's drain strategy: consumers started on
   the enqueued jobs), durability `balanced` (the log tables unlogged), `pgq autovac`'s
   table settings, asyncio instead of uvloop; procrastinate delete_jobs=always, a pool
   as large as the concurrency, polling instead of LISTEN/NOTIFY; RabbitMQ one
   multiple=True ack per 50 messages, a durable classic queue, confirm windows of 100 and
   5 000. Rows marked † are not documented settings of the peer but the setting Pepsi
   runs with (pgqueuer's connections with synchronous_commit off, as Pepsi's workers
   commit outcomes), for the reader to weigh.

Every rep sets each setting up afresh (its scratch database, its consumer processes, a
warm-up of 200 messages), runs it once and closes it, so no more than one setting holds
connections at a time and the reps are interleaved (A B C ... A B C ...). A fresh
database has no planner statistics and no dead rows yet: what a long-lived queue table
goes through (an autoanalyze while it is empty, then a burst) is race.py's to show, where
the reps share one database. Each cell is
the median and min..max over the reps; CPU per 1 000 messages as in race.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from race import fmt, log, one_rep, rate_table, summarize
from race_peers import (
    Contestant,
    Shared,
    StampSocket,
    Unsupported,
    drop_database,
    find_rabbitmq,
    postmaster_pid,
    server_dsn,
)
from race_rivals import PgQueuer, Procrastinate, RabbitMQ

DRAINS = ("drain_preloaded", "drain")
Make = Callable[[Shared], Contestant]


# -- the settings ---------------------------------------------------------------------------


def pgqueuer_grid() -> list[tuple[tuple[int, int], Make]]:
    return [
        ((c, b), lambda sh, c=c, b=b: PgQueuer(sh, c, batch=b))
        for c in (1, 2, 4)
        for b in (10, 25, 50, 100, 250, 500, 1000)
    ]


def pgqueuer_extras(best: tuple[int, int]) -> list[Make]:
    c, b = best
    extras: list[Make] = [
        lambda sh: PgQueuer(sh, 1, batch=10, managers=5),  # its benchmark tool's defaults
        lambda sh: PgQueuer(sh, 4, batch=10, mode="drain"),  # issue 36's reference setting
        lambda sh: PgQueuer(sh, c, batch=b, mode="drain"),
        lambda sh: PgQueuer(sh, c, batch=b, durability="balanced"),
        lambda sh: PgQueuer(sh, c, batch=b, autovac=True),
        lambda sh: PgQueuer(sh, c, batch=b, durability="balanced", autovac=True),
        lambda sh: PgQueuer(sh, c, batch=b, uvloop=False),
        lambda sh: PgQueuer(sh, c, batch=b, sync_commit=False),  # † Pepsi's workers' setting
    ]
    if c > 1:
        extras.insert(1, lambda sh: PgQueuer(sh, 1, batch=b, managers=c))
    return extras


def procrastinate_grid() -> list[tuple[tuple[int, int], Make]]:
    return [
        ((p, c), lambda sh, c=c, p=p: Procrastinate(sh, c, processes=p))
        for p in (1, 2)
        for c in (1, 4, 10, 30)
    ]


def procrastinate_extras(best: tuple[int, int]) -> list[Make]:
    p, c = best
    return [
        lambda sh: Procrastinate(sh, c, processes=p, delete_jobs="always"),
        lambda sh: Procrastinate(sh, c, processes=p, pool=c + 2),
        lambda sh: Procrastinate(sh, c, processes=p, listen_notify=False, polling=0.01),
    ]


def rabbitmq_grid() -> list[tuple[tuple[int, int], Make]]:
    return [
        ((n, pf), lambda sh, n=n, pf=pf: RabbitMQ(sh, n, prefetch=pf))
        for n in (1, 2)
        for pf in (100, 300, 1000)
    ]


def rabbitmq_extras(best: tuple[int, int]) -> list[Make]:
    n, pf = best
    return [
        lambda sh: RabbitMQ(sh, n, prefetch=pf, ack_every=50),
        lambda sh: RabbitMQ(sh, n, prefetch=pf, queue_type="classic"),
        lambda sh: RabbitMQ(sh, n, prefetch=pf, window=100),
        lambda sh: RabbitMQ(sh, n, prefetch=pf, window=5000),
    ]


PEERS: dict[str, tuple[Callable[[], list[Any]], Callable[[Any], list[Make]], str, str, int]] = {
    # grid, extras, the grid's row and column names, default --messages
    "pgqueuer": (pgqueuer_grid, pgqueuer_extras, "consumers", "batch_size", 20_000),
    "procrastinate": (procrastinate_grid, procrastinate_extras, "processes", "concurrency", 5000),
    "rabbitmq": (rabbitmq_grid, rabbitmq_extras, "consumers", "prefetch", 20_000),
}


# -- running --------------------------------------------------------------------------------


def run_settings(
    makes: list[Make], shared: Shared, args: argparse.Namespace, pm: int | None
) -> dict[str, dict[str, dict[str, Any]]]:
    """{workload: {label: cell}}: every setting set up, run and closed once per rep."""
    contestants = [make(shared) for make in makes]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in args.workloads:
        cells = out[workload] = {c.label: {"reps": []} for c in contestants}
        for rep in range(args.reps):
            for c in contestants:
                if "skipped" not in cells[c.label]:
                    one_setting(workload, c, args, pm, rep=rep, cell=cells[c.label])
        for cell in cells.values():
            summarize(cell)
    return out


def one_setting(
    workload: str,
    c: Contestant,
    args: argparse.Namespace,
    pm: int | None,
    *,
    rep: int,
    cell: dict[str, Any],
) -> None:
    try:
        c.setup(workload)
        result = one_rep(workload, c, args, pm)
        cell["reps"].append(result)
        log(f"  {workload} rep {rep + 1} {c.label}: {result['per_s']:.0f}/s")
    except Unsupported as exc:
        cell.clear()
        cell["skipped"] = str(exc)
    except Exception as exc:  # noqa: BLE001  # one broken setting must not end the sweep
        why = f"rep {rep + 1}: {exc!r}" + (f" ({c.died()})" if c.died() else "")
        log(f"  {workload} {c.label}: {why}")
        traceback.print_exc(file=sys.stderr)
        cell.setdefault("failed_reps", []).append(why)
    finally:
        try:
            c.close()
            if c.dbname:
                drop_database(c.dbname)
        except Exception as exc:  # noqa: BLE001
            log(f"  {c.label}: close failed: {exc!r}")


def best_point(
    grid: list[tuple[tuple[int, int], Make]], cells: dict[str, Any], labels: list[str]
) -> tuple[int, int]:
    rates = {
        point: cells[label]["per_s"]["median"]
        for (point, _), label in zip(grid, labels, strict=True)
        if "per_s" in cells[label]
    }
    if not rates:
        raise SystemExit("no setting of the grid ran")
    return max(rates, key=lambda point: rates[point])


# -- reporting ------------------------------------------------------------------------------


def pivot(
    grid: list[tuple[tuple[int, int], Make]],
    labels: list[str],
    cells: dict[str, Any],
    names: tuple[str, str],
) -> list[str]:
    """The grid as a table: rows and columns are its two knobs, cells msg/s medians."""
    rows = sorted({p[0] for p, _ in grid})
    cols = sorted({p[1] for p, _ in grid})
    value = {
        point: cells[label].get("per_s", {}).get("median")
        for (point, _), label in zip(grid, labels, strict=True)
    }
    best = max((v for v in value.values() if v), default=None)
    lines = [
        f"| {names[0]} \\ {names[1]} | " + " | ".join(str(c) for c in cols) + " |",
        "|---:|" + "---:|" * len(cols),
    ]
    for r in rows:
        texts = []
        for c in cols:
            v = value.get((r, c))
            texts.append(("**" + fmt(v) + "**" if v == best else fmt(v)) if v else "–")
        lines.append(f"| {r} | " + " | ".join(texts) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer", choices=sorted(PEERS), required=True)
    parser.add_argument("--only", default=",".join(DRAINS), help="drain_preloaded,drain")
    parser.add_argument("--messages", type=int, help="per run (pgqueuer, RabbitMQ 20 000; "
                        "procrastinate 5 000: it drains ~500/s)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-extras", action="store_true", help="the grid only")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    grid_of, extras_of, row, col, default_n = PEERS[args.peer]
    args.messages = args.messages or default_n
    args.workloads = [w for w in args.only.split(",") if w]
    if set(args.workloads) - set(DRAINS):
        parser.error(f"--only takes {', '.join(DRAINS)}")
    pm = postmaster_pid(server_dsn())
    results: dict[str, Any] = {"peer": args.peer, "messages": args.messages, "reps": args.reps}
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        shared = Shared(Path(tmp), StampSocket(Path(tmp) / "stamps.sock"), find_rabbitmq())
        try:
            grid = grid_of()
            labels = [make(shared).label for _, make in grid]
            log(f"== {args.peer}: grid of {len(grid)} settings")
            results["grid"] = run_settings([m for _, m in grid], shared, args, pm)
            first = results["grid"][args.workloads[0]]
            results["best_point"] = best = best_point(grid, first, labels)
            if not args.no_extras:
                log(f"== {args.peer}: further knobs at {row} {best[0]}, {col} {best[1]}")
                results["extras"] = run_settings(extras_of(best), shared, args, pm)
        finally:
            if shared.rabbit is not None:
                shared.rabbit.close()
            shared.stamps.close()
    print(json.dumps(results, indent=2, ensure_ascii=False))
    text = report(results, grid, labels, (row, col))
    print(text)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    return 0


def report(
    results: dict[str, Any],
    grid: list[tuple[tuple[int, int], Make]],
    labels: list[str],
    names: tuple[str, str],
) -> str:
    out = []
    n, reps = results["messages"], results["reps"]
    for workload, cells in results["grid"].items():
        out += [f"**{results['peer']}, {workload}**: {n} messages, median msg/s of {reps} reps", ""]
        out += [*pivot(grid, labels, cells, names), ""]
        every = {**cells, **results.get("extras", {}).get(workload, {})}
        best = max(
            (label for label, cell in every.items() if "per_s" in cell),
            key=lambda label: every[label]["per_s"]["median"],
            default=None,
        )
        out += [*rate_table(every, best, "best"), ""]
        if best:
            spread = [c["per_s"]["median"] for c in every.values() if "per_s" in c]
            out += [
                f"best: {best} {fmt(every[best]['per_s']['median'])} msg/s"
                f" (median of all settings {fmt(statistics.median(spread))})",
                "",
            ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
