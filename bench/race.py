"""Pepsi against its peers, side by side in one run, on the same PostgreSQL server.

    .venv/bin/pip install -e '.[dev,bench]'      # pgqueuer, procrastinate, pika, psutil
    .venv/bin/python bench/race.py [--quick] [--reps 3] [--only drain,publish_one,...]
                                   [--sustained SECONDS] [--json FILE]

Peers, in the drains at their defaults and at their best setting found by
bench/peer_sweep.py (a grid and every further knob their documentation names for
throughput; `pgqueuer_lineup` and friends below say which won): pgqueuer through
asyncpg on uvloop as `pgq run` runs it (its defaults: one consumer, batch_size
10; issue 36's reference, 4 consumers at batch_size 10; its best, 1 consumer at
batch_size 1 000 and 4 at 500, with `pgq autovac`), procrastinate (one worker, async tasks,
--procrastinate-concurrency; and 2 workers with delete_jobs=always), RabbitMQ (a
quorum queue through pika, only if a `rabbitmq-server` is installed: this script
never installs anything; it starts a private node when a RabbitMQ contestant
first needs it and stops it; one consumer at prefetch 100, one ack a message;
its best, 2 consumers at prefetch 100 acking 50 at a time with multiple=True),
and raw psycopg loops as ceilings. Elsewhere the peers run their defaults. Every
PostgreSQL contestant uses its own scratch database on the embedded (or
$PEPSI_DSN's) server. Handlers are no-ops everywhere. Reps are interleaved (A B
C A B C ...); each cell is the median and min..max over reps.

Workloads (--only takes these names):
  drain          1 stage: consumers running and warm (messages through first:
                 200; Pepsi, 500 at a time until its pool has all its workers),
                 N messages published in batches of 1 000 in one go;
                 the clock runs from just before the first publish until the
                 last message is done (PostgreSQL contestants: polled every
                 10 ms; RabbitMQ: its consumer reports the last ack). Pepsi
                 runs its DEFAULT configuration (only HANDLER). Raw SQL: one
                 UPDATE ... WHERE id = $1 per message and commit (the "hop by
                 primary key", synchronous_commit off like Pepsi's workers),
                 on 1 and 2 connections, rows inserted before the clock.
  drain_preloaded  the same, the N messages enqueued first (the workload
                 pgqueuer's own benchmark tool calls drain): in one
                 transaction with the consumers warm and waiting, the clock
                 from its commit (Pepsi publish_many, pgqueuer one enqueue
                 statement, procrastinate one batch_defer; RabbitMQ: published
                 and confirmed while the consumers are held back, the clock
                 from their go). No publishing competes with the consumers
                 for the 2 cores, and no producer's cost is in the rate: the
                 drain alone. CPU probes start just after the commit.
  drain3         Pepsi, 3 stages s1 -> s2 -> s3, default settings: msg/s, hops/s.
  latency        idle, warm system; one message every 20 ms; from just before
                 the publish call to the handler's start (the handler sends
                 time.monotonic_ns(), system-wide on Linux, to a UNIX socket).
  publish_one    confirmed 1 KB publishes, one per call (K messages).
  publish_batch  confirmed 1 KB publishes in batches of 1 000 (RabbitMQ: a
                 confirm window of 1 000; the Pepsi async Pipeline: defaults).
  fairness       Pepsi, 1 stage, N messages from 100 and 2 000 senders
                 (OutgoingMessage.user), FAIR_SCHEDULING yes vs no.
  sustained      only with --sustained S: Pepsi, 1 stage, a producer keeping
                 the backlog under 20 000; processed msg/s per minute and
                 pepsi.workqueue's live/dead tuples and size every 10 s.

CPU per 1 000 messages (ms) of each drain/publish run, by role: the client
(this process), the dispatcher and its workers (or the peer's consumers,
the RabbitMQ broker) and PostgreSQL (the postmaster and all its backends:
other users of the server count too), from psutil before/after each run;
`core_share` is CPU seconds per wall second (1.0 = one core). `other load`
is what the machine's cores spent on anything else meanwhile (other users,
steal), in cores: a run next to a high one was disturbed.

Prints a JSON document (also to --json FILE), markdown tables for
docs/performance.md and one SUMMARY line (Pepsi / best peer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import psycopg
from race_peers import (
    BATCH,
    Contestant,
    CpuProbe,
    Pepsi,
    RawSql,
    Shared,
    StampSocket,
    Unsupported,
    drop_database,
    find_rabbitmq,
    postmaster_pid,
    server_dsn,
)
from race_rivals import PgQueuer, Procrastinate, RabbitMQ

WORKLOADS = (
    "drain",
    "drain_preloaded",
    "drain3",
    "latency",
    "publish_one",
    "publish_batch",
    "fairness",
)
PEERS = ("pgqueuer", "procrastinate", "rabbitmq")  # labels starting with these are peers
SUSTAINED_BACKLOG = 20_000
MAX_FAILURES = 2  # failed reps before a contestant is dropped from a workload


# -- the line-ups -------------------------------------------------------------


def pgqueuer_lineup(shared: Shared) -> list[Contestant]:
    """pgqueuer at its defaults, at issue 36's reference setting, and at the two best
    settings of bench/peer_sweep.py (within its noise of each other): batch_size is the
    knob (its performance guide: raise it for short jobs), from 2-5 k/s at 10 to 15-35 k/s
    at 250-1 000 on 2 shared cores; the consumer count matters less; durability
    `balanced`, one process of several PgQueuer instances, asyncio instead of uvloop and
    drain mode were no faster. With `pgq autovac`'s table settings, as its production
    checklist says (no faster or slower on the sweep's fresh databases).

    Here the reps share one database per contestant, and pgqueuer's table sits empty
    while the others run: an autoanalyze then records it empty, and the next burst's
    dequeue plan turns into a nested loop over every queued row for each batch (EXPLAIN
    ANALYZE of one dequeue of 1 000 from 20 000: 10.6 s, against 14 ms on a table never
    analyzed): those reps drain at a few hundred jobs/s, autovac or not. The sweep's
    fresh databases show pgqueuer without that trap."""
    return [
        PgQueuer(shared, 1),
        PgQueuer(shared, 4),
        PgQueuer(shared, 1, batch=1000, autovac=True),
        PgQueuer(shared, 4, batch=500, autovac=True),
    ]


def procrastinate_lineup(shared: Shared, concurrency: list[int]) -> list[Contestant]:
    """procrastinate at each concurrency asked for, and the first in 2 worker processes
    with delete_jobs=always (what helped in bench/peer_sweep.py, within its noise: 2-5 x
    100-700 msg/s whatever the setting)."""
    return [
        *(Procrastinate(shared, c) for c in concurrency),
        Procrastinate(shared, concurrency[0], processes=2, delete_jobs="always"),
    ]


def rabbitmq_lineup(shared: Shared) -> list[Contestant]:
    """RabbitMQ's quorum queue, 1 consumer at prefetch 100, and its best setting in
    bench/peer_sweep.py: 2 consumers at prefetch 100 acking 50 messages at a time
    (multiple=True, RabbitMQ's advice for throughput); a classic queue was no faster."""
    return [RabbitMQ(shared), RabbitMQ(shared, 2, prefetch=100, ack_every=50)]


def lineup(workload: str, shared: Shared, args: argparse.Namespace) -> list[Contestant]:
    """The contestants of one workload, in the order they run within a rep."""
    conc = args.procrastinate_concurrency[0]
    if workload in {"drain", "drain_preloaded"}:
        return [
            Pepsi(shared, "Pepsi", Pepsi.config_text()),
            *pgqueuer_lineup(shared),
            *procrastinate_lineup(shared, args.procrastinate_concurrency),
            *rabbitmq_lineup(shared),
            RawSql(shared, 1),
            RawSql(shared, 2),
        ]
    if workload == "drain3":
        return [Pepsi(shared, "Pepsi 3 stages", Pepsi.config_text(stages=3))]
    if workload == "latency":
        return [
            Pepsi(shared, "Pepsi", Pepsi.config_text(handler="stamp")),
            Pepsi(shared, "Pepsi FIFO", Pepsi.config_text(fair=False, handler="stamp")),
            PgQueuer(shared, 1),
            Procrastinate(shared, conc),
            RabbitMQ(shared),
        ]
    if workload == "publish_one":
        return [
            Pepsi(shared, "Pepsi", Pepsi.config_text()),
            PgQueuer(shared, 0),
            Procrastinate(shared, conc),
            RabbitMQ(shared),
            RawSql(shared, 1),
        ]
    if workload == "publish_batch":
        return [
            Pepsi(shared, "Pepsi publish_many", Pepsi.config_text()),
            Pepsi(shared, "Pepsi async Pipeline", Pepsi.config_text(), async_pipeline=True),
            PgQueuer(shared, 0),
            Procrastinate(shared, conc),
            RabbitMQ(shared),
            RawSql(shared, 1),
        ]
    if workload == "fairness":
        return [
            Pepsi(
                shared, f"Pepsi {kind} {senders} senders", Pepsi.config_text(fair), senders=senders
            )
            for senders in (100, 2000)
            for kind, fair in (("fair", True), ("FIFO", False))
        ]
    raise ValueError(workload)


# -- measuring ----------------------------------------------------------------


def cpu_probes(c: Contestant, postmaster: int | None) -> dict[str, CpuProbe]:
    probes = {"client": CpuProbe([os.getpid()], "own"), **c.cpu_roles()}
    if postmaster is not None:
        probes["postgres"] = CpuProbe([postmaster])
    return probes


def timed_run(
    c: Contestant, run: Callable[[int], float], n: int, postmaster: int | None
) -> dict[str, Any]:
    """One measured run of n messages: rate, CPU per 1 000 messages and core shares."""
    probes = cpu_probes(c, postmaster)
    before = {role: probe() for role, probe in probes.items()}
    busy_before, wall_before = machine_busy(), time.perf_counter()
    seconds = run(n)
    busy, wall = machine_busy() - busy_before, time.perf_counter() - wall_before
    used = {role: probe() - before[role] for role, probe in probes.items()}
    used["total"] = sum(used.values())
    return {
        "messages": n,
        "seconds": round(seconds, 3),
        "per_s": round(n / seconds, 1),
        "cpu_ms_per_1k": {r: round(v / n * 1e6, 1) for r, v in used.items()},
        "core_share": {r: round(v / seconds, 3) for r, v in used.items()},
        # CPU the machine spent on anything else meanwhile (other users, steal), in cores
        "other_load_cores": round(max(0.0, busy - used["total"]) / wall, 2),
    }


def machine_busy() -> float:
    """CPU seconds all cores have spent busy since boot (steal included: not ours)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def latency_run(c: Contestant, samples: int) -> dict[str, Any]:
    times = []
    for _ in range(samples):
        time.sleep(0.02)  # let the system go idle between samples
        c.shared.stamps.clear()
        times.append(c.latency())
    times.sort()
    return {
        "samples": samples,
        "median_ms": round(statistics.median(times), 2),
        "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 2),
        "max_ms": round(times[-1], 2),
    }


def one_rep(
    workload: str, c: Contestant, args: argparse.Namespace, pm: int | None
) -> dict[str, Any]:
    c.warm()
    if workload in {"drain", "drain3", "fairness"}:
        return timed_run(c, c.drain, args.messages, pm)
    if workload == "drain_preloaded":
        c.preload(args.messages)  # before the CPU probes and the clock
        return timed_run(c, c.drain_preloaded, args.messages, pm)
    if workload == "latency":
        return latency_run(c, args.samples)
    run = c.publish_one if workload == "publish_one" else c.publish_batch
    n = args.publish_one if workload == "publish_one" else args.publish_batch
    c.reset()
    try:
        return timed_run(c, run, n, pm)
    finally:
        c.reset()


def run_workload(
    workload: str, shared: Shared, args: argparse.Namespace, pm: int | None
) -> dict[str, Any]:
    """Set up every contestant, run the interleaved reps, close them all."""
    cells: dict[str, dict[str, Any]] = {}
    contestants = [
        c
        for c in lineup(workload, shared, args)
        if not args.filter or any(f.lower() in c.label.lower() for f in args.filter.split(","))
    ]
    try:
        active = set_up(contestants, workload, cells)
        for rep in range(args.reps):
            for c in list(active):
                if not run_rep(workload, c, args, pm, rep=rep, cell=cells[c.label]):
                    active.remove(c)
    finally:
        for c in contestants:
            try:
                c.close()
                if c.dbname:
                    drop_database(c.dbname)
            except Exception as exc:  # noqa: BLE001
                log(f"  {c.label}: close failed: {exc!r}")
    for cell in cells.values():
        summarize(cell)
    return cells


def set_up(
    contestants: list[Contestant], workload: str, cells: dict[str, dict[str, Any]]
) -> list[Contestant]:
    """Set each contestant up; those that cannot take part get a skipped/error cell."""
    active = []
    for c in contestants:
        cells[c.label] = {"reps": []}
        try:
            c.setup(workload)
            active.append(c)
        except Unsupported as exc:
            cells[c.label] = {"skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001  # a broken peer must not stop the race
            cells[c.label] = {"error": f"setup: {exc!r}"}
            log(f"  {c.label}: setup failed: {exc!r}")
            c.close()
    return active


def run_rep(
    workload: str,
    c: Contestant,
    args: argparse.Namespace,
    pm: int | None,
    *,
    rep: int,
    cell: dict[str, Any],
) -> bool:
    """One rep of one contestant into its cell; False: drop it from this workload."""
    try:
        result = one_rep(workload, c, args, pm)
    except Unsupported as exc:
        cell.clear()
        cell["skipped"] = str(exc)
        return False
    except Exception as exc:  # noqa: BLE001
        why = f"rep {rep + 1}: {exc!r}" + (f" ({c.died()})" if c.died() else "")
        log(f"  {c.label}: {why}")
        traceback.print_exc(file=sys.stderr)
        cell.setdefault("failed_reps", []).append(why)
        return recover(c, workload, len(cell["failed_reps"]))
    cell["reps"].append(result)
    log(f"  rep {rep + 1} {c.label}: {brief(result)}")
    return True


def recover(c: Contestant, workload: str, failures: int) -> bool:
    """Set a failed contestant up afresh for its next rep (Pepsi's code changes under us)."""
    if failures >= MAX_FAILURES:
        return False
    try:
        c.close()
        c.setup(workload)
        return True
    except Exception as exc:  # noqa: BLE001
        log(f"  {c.label}: could not set up again: {exc!r}")
        return False


def brief(result: dict[str, Any]) -> str:
    if "per_s" in result:
        return f"{result['per_s']:.0f}/s in {result['seconds']:.2f} s"
    return f"median {result['median_ms']} ms, p99 {result['p99_ms']} ms"


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)}


def summarize(cell: dict[str, Any]) -> None:
    """Add median and min..max over the reps of every number of a cell."""
    reps = cell.get("reps") or []
    if not reps:
        return
    keys = [
        k for k in ("per_s", "median_ms", "p99_ms", "max_ms", "other_load_cores") if k in reps[0]
    ]
    for key in keys:
        cell[key] = spread([r[key] for r in reps])
    for group in ("cpu_ms_per_1k", "core_share"):
        if group in reps[0]:
            cell[group] = {
                role: round(statistics.median(r[group][role] for r in reps), 3)
                for role in reps[0][group]
            }


def sustained(shared: Shared, seconds: float, pm: int | None) -> dict[str, Any]:
    """Pepsi 1 stage under a producer at full speed with a bounded backlog."""
    pepsi = Pepsi(shared, "Pepsi sustained", Pepsi.config_text())
    samples: list[dict[str, Any]] = []
    try:
        pepsi.setup("sustained")
        pepsi.warm()
        assert pepsi.publisher is not None
        assert pepsi.db is not None
        batch = pepsi.messages(BATCH)
        published = 0
        start = time.monotonic()
        next_sample = start
        while (now := time.monotonic()) - start < seconds:
            if now >= next_sample:
                samples.append(table_sample(pepsi.db, now - start, published - pepsi.pending()))
                log(f"  sustained {samples[-1]}")
                next_sample += 10
            if not pepsi.alive():
                raise RuntimeError("the dispatcher died")
            if pepsi.pending() < SUSTAINED_BACKLOG:
                pepsi.publisher.publish_many(batch)
                published += BATCH
            else:
                time.sleep(0.05)
        samples.append(
            table_sample(pepsi.db, time.monotonic() - start, published - pepsi.pending())
        )
    finally:
        pepsi.close()
        if pepsi.dbname:
            drop_database(pepsi.dbname)
    minutes = per_minute(samples)
    mean = samples[-1]["processed"] / samples[-1]["t"] if samples and samples[-1]["t"] else 0
    result: dict[str, Any] = {
        "seconds": seconds,
        "mean_msg_s": round(mean, 1),
        "per_minute_msg_s": minutes,
        "samples": samples,
    }
    if len(minutes) >= 2:
        result["last_over_first_minute"] = round(minutes[-1] / minutes[0], 3)
    return result


def table_sample(db: psycopg.Connection[Any], t: float, processed: int) -> dict[str, Any]:
    row = db.execute(
        "SELECT n_live_tup, n_dead_tup, pg_total_relation_size('pepsi.workqueue')"
        " FROM pg_stat_user_tables WHERE schemaname = 'pepsi' AND relname = 'workqueue'"
    ).fetchone()
    live, dead, size = row if row else (None, None, None)
    return {"t": round(t, 1), "processed": processed, "live": live, "dead": dead, "bytes": size}


def per_minute(samples: list[dict[str, Any]]) -> list[float]:
    """Processed msg/s in each full minute, from the 10-second samples."""
    rates = []
    by_t = {round(s["t"] / 10) * 10: s["processed"] for s in samples}
    minute = 60
    while minute in by_t and minute - 60 in by_t:
        rates.append(round((by_t[minute] - by_t[minute - 60]) / 60, 1))
        minute += 60
    return rates


# -- reporting ----------------------------------------------------------------


def fmt(x: float | None, digits: int = 0) -> str:
    if x is None:
        return "–"
    return f"{x:,.{digits}f}".replace(",", " ")


def cell_range(stat: dict[str, float], digits: int = 0) -> str:
    return f"{fmt(stat['median'], digits)} ({fmt(stat['min'], digits)}–{fmt(stat['max'], digits)})"


def cpu_text(cell: dict[str, Any]) -> str:
    cpu = cell.get("cpu_ms_per_1k") or {}
    parts = [f"{role} {fmt(v)}" for role, v in cpu.items() if role != "total"]
    return " · ".join(parts) + (f" = **{fmt(cpu['total'])}**" if "total" in cpu else "")


def not_run(cell: dict[str, Any]) -> str | None:
    if "per_s" in cell or "median_ms" in cell:
        return None
    if "skipped" in cell:
        return f"skipped: {cell['skipped']}"
    return f"failed: {cell.get('error') or '; '.join(cell.get('failed_reps', []))}"


def shown(label: str, cell: dict[str, Any]) -> str:
    """The label, bold for the best peer, ✓ for the best of several settings of a system."""
    text = f"**{label}**" if cell.get("best_peer") else label
    text += " ✓" if cell.get("best_setting") else ""
    failed = len(cell.get("failed_reps", []))
    return text + (f" ({failed} rep{'s' if failed > 1 else ''} failed)" if failed else "")


def rate_table(cells: dict[str, Any], reference: str | None, ref_name: str) -> list[str]:
    ref = cells.get(reference or "", {}).get("per_s", {}).get("median")
    lines = [
        f"| system | msg/s median (min–max) | ÷ {ref_name} | CPU ms per 1 000 msgs | other load |",
        "|---|---:|---:|---|---:|",
    ]
    for label, cell in cells.items():
        if reason := not_run(cell):
            lines.append(f"| {label} | {reason} | | | |")
            continue
        rate = cell["per_s"]["median"]
        ratio = f"{rate / ref:.2f}" if ref else "–"
        rates = cell_range(cell["per_s"])
        other = fmt(cell["other_load_cores"]["median"], 2)
        lines.append(f"| {shown(label, cell)} | {rates} | {ratio} | {cpu_text(cell)} | {other} |")
    return lines


def latency_table(cells: dict[str, Any]) -> list[str]:
    lines = [
        "| system | median ms | p99 ms | max ms |",
        "|---|---:|---:|---:|",
    ]
    for label, cell in cells.items():
        if reason := not_run(cell):
            lines.append(f"| {label} | {reason} | | |")
            continue
        median, p99 = cell_range(cell["median_ms"], 2), cell_range(cell["p99_ms"], 1)
        worst = cell_range(cell["max_ms"], 1)
        lines.append(f"| {shown(label, cell)} | {median} | {p99} | {worst} |")
    return lines


def fairness_table(cells: dict[str, Any]) -> list[str]:
    lines = ["| senders | fair msg/s | FIFO msg/s | fair ÷ FIFO |", "|---:|---:|---:|---:|"]
    for senders in (100, 2000):
        fair = cells.get(f"Pepsi fair {senders} senders", {})
        fifo = cells.get(f"Pepsi FIFO {senders} senders", {})
        if "per_s" not in fair or "per_s" not in fifo:
            lines.append(f"| {senders} | {not_run(fair) or ''} | {not_run(fifo) or ''} | |")
            continue
        ratio = fair["per_s"]["median"] / fifo["per_s"]["median"]
        rates = f"{cell_range(fair['per_s'])} | {cell_range(fifo['per_s'])}"
        lines.append(f"| {senders} | {rates} | {ratio:.2f} |")
    return lines


def best_peer(cells: dict[str, Any], key: str, lowest: bool = False) -> tuple[str, float] | None:
    found = [
        (label, cell[key]["median"])
        for label, cell in cells.items()
        if label.lower().startswith(PEERS) and key in cell
    ]
    if not found:
        return None
    return (min if lowest else max)(found, key=lambda item: item[1])


def mark_best(cells: dict[str, Any], key: str, lowest: bool = False) -> None:
    """Flag the best peer, and the best setting of a peer run in several settings."""
    best = best_peer(cells, key, lowest)
    if best:
        cells[best[0]]["best_peer"] = True
    families: dict[str, list[str]] = {}
    for label, cell in cells.items():
        if key in cell:
            families.setdefault(label.split()[0], []).append(label)
    for labels in families.values():
        if len(labels) > 1:
            pick = min if lowest else max
            cells[pick(labels, key=lambda lb: cells[lb][key]["median"])]["best_setting"] = True


def markdown(results: dict[str, Any]) -> str:
    w = results["workloads"]
    reps = results["settings"]["reps"]
    out = [
        f"Race, {results['settings']['date']}: {results['machine']['cpus']} cores, "
        f"PostgreSQL {results['machine']['postgres']}, Python {results['machine']['python']}, "
        f"{reps} interleaved reps (median, min–max). Best peer in **bold**; ✓ the best"
        " setting of a system run in several. CPU: ms per 1 000 messages by role (PostgreSQL:"
        " the whole server); other load: cores busy with anything else during the run.",
        "",
    ]

    n = results["settings"]["messages"]
    for key, how in (
        ("drain", "published in batches of 1 000 while they drain"),
        ("drain_preloaded", "enqueued first, in one transaction"),
    ):
        if key in w:
            out += [f"**Drain, 1 stage** ({n} messages {how}; no-op handlers, warm consumers)"]
            out += ["", *rate_table(w[key], "Pepsi", "Pepsi"), ""]
    if "drain3" in w:
        cell = w["drain3"].get("Pepsi 3 stages", {})
        out += ["**Drain, 3 stages** (Pepsi, default settings)", ""]
        if "per_s" in cell:
            hops = {k: v * 3 for k, v in cell["per_s"].items()}
            out += [
                "| msg/s | hops/s | CPU ms per 1 000 msgs | other load |",
                "|---:|---:|---|---:|",
                f"| {cell_range(cell['per_s'])} | {cell_range(hops)} | {cpu_text(cell)}"
                f" | {fmt(cell['other_load_cores']['median'], 2)} |",
                "",
            ]
        else:
            out += [f"{not_run(cell)}", ""]
    if "latency" in w:
        samples = results["settings"]["samples"]
        out += [f"**Idle publish → handler start** ({samples} samples, 20 ms apart)", ""]
        out += [*latency_table(w["latency"]), ""]
    for key, title in (("publish_one", "one per call"), ("publish_batch", "batches of 1 000")):
        if key in w:
            n = results["settings"][key]
            out += [f"**Publish, {title}** ({n} confirmed 1 KB messages)", ""]
            out += [*rate_table(w[key], "raw SQL ×1", "raw"), ""]
    if "fairness" in w:
        out += [f"**Fair scheduling** (Pepsi 1 stage, {results['settings']['messages']} msgs)", ""]
        out += [*fairness_table(w["fairness"]), ""]
        out += [*rate_table(w["fairness"], "Pepsi FIFO 100 senders", "FIFO 100"), ""]
    if "sustained" in results:
        s = results["sustained"]
        out += [
            f"**Sustained** (Pepsi 1 stage, {s.get('seconds')} s, backlog < 20 000): mean"
            f" {fmt(s.get('mean_msg_s'))} msg/s; per minute "
            f"{', '.join(fmt(m) for m in s.get('per_minute_msg_s', []))}; last ÷ first "
            f"{s.get('last_over_first_minute', '–')}",
            "",
        ]
    if results["skipped"]:
        out += ["Skipped: " + "; ".join(results["skipped"]), ""]
    return "\n".join(out)


def ratio_text(name: str, cells: dict[str, Any], pepsi: str, key: str, lowest: bool = False) -> str:
    mine = cells.get(pepsi, {}).get(key, {}).get("median")
    best = best_peer(cells, key, lowest)
    if mine is None or best is None:
        return f"{name} n/a"
    digits = 1 if lowest else 0
    return (
        f"{name} Pepsi {fmt(mine, digits)} / {best[0]} {fmt(best[1], digits)}"
        f" = {mine / best[1]:.2f}x"
    )


def summary(results: dict[str, Any]) -> str:
    w = results["workloads"]
    parts = []
    for key in ("drain", "drain_preloaded"):
        if key in w:
            parts.append(ratio_text(key, w[key], "Pepsi", "per_s"))
            share = w[key].get("Pepsi", {}).get("core_share", {}).get("dispatcher")
            if share is not None:
                parts.append(f"dispatcher {share:.2f} core")
    if "drain3" in w and "per_s" in w["drain3"].get("Pepsi 3 stages", {}):
        rate = w["drain3"]["Pepsi 3 stages"]["per_s"]["median"]
        parts.append(f"3 stages {fmt(rate)} msg/s ({fmt(rate * 3)} hops/s)")
    if "latency" in w:
        parts.append(
            ratio_text("latency median ms", w["latency"], "Pepsi", "median_ms", lowest=True)
        )
    for key, pepsi in (("publish_one", "Pepsi"), ("publish_batch", "Pepsi publish_many")):
        if key in w:
            text = ratio_text(key, w[key], pepsi, "per_s")
            raw = w[key].get("raw SQL ×1", {}).get("per_s", {}).get("median")
            mine = w[key].get(pepsi, {}).get("per_s", {}).get("median")
            if raw and mine:
                text += f" ({mine / raw:.2f}x raw)"
            parts.append(text)
    if "fairness" in w:
        for senders in (100, 2000):
            fair = w["fairness"].get(f"Pepsi fair {senders} senders", {}).get("per_s")
            fifo = w["fairness"].get(f"Pepsi FIFO {senders} senders", {}).get("per_s")
            if fair and fifo:
                parts.append(f"fair/FIFO {senders} senders {fair['median'] / fifo['median']:.2f}x")
    if "last_over_first_minute" in results.get("sustained", {}):
        parts.append(
            f"sustained last/first minute {results['sustained']['last_over_first_minute']}x"
        )
    return "SUMMARY " + "; ".join(parts)


# -- main ---------------------------------------------------------------------


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="small sizes, 2 reps")
    add("--reps", type=int, help="interleaved reps (default 3; --quick 2)")
    add("--only", metavar="W[,W...]", help=f"a subset of {','.join(WORKLOADS)}")
    add("--filter", metavar="S[,S...]", help="only contestants whose label contains one")
    add("--sustained", type=float, metavar="SECONDS", help="add the sustained run")
    add("--json", type=Path, metavar="FILE", help="also write the JSON here")
    add("--messages", type=int, metavar="N", help="drain size (20 000; --quick 5 000)")
    add("--samples", type=int, metavar="N", help="latency samples (200; --quick 50)")
    add("--publish-one", type=int, metavar="K", help="single publishes (3 000; --quick 1 000)")
    add("--publish-batch", type=int, metavar="N", help="batched (50 000; --quick 10 000)")
    add(
        "--procrastinate-concurrency", default="10", metavar="C[,C...]",
        help="procrastinate worker concurrency; several race each other in the drain, the"
        " first is used elsewhere (default 10: on 2 cores 1 was slowest, 4 to 100 alike)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    args.procrastinate_concurrency = [int(c) for c in args.procrastinate_concurrency.split(",")]
    quick = args.quick
    args.reps = args.reps or (2 if quick else 3)
    args.messages = args.messages or (5000 if quick else 20_000)
    args.samples = args.samples or (50 if quick else 200)
    args.publish_one = args.publish_one or (1000 if quick else 3000)
    args.publish_batch = args.publish_batch or (10_000 if quick else 50_000)
    args.workloads = [w for w in WORKLOADS if not args.only or w in args.only.split(",")]
    unknown = set((args.only or "").split(",")) - set(WORKLOADS) - {"", "sustained"}
    if unknown:
        parser.error(f"unknown workloads: {', '.join(sorted(unknown))}")
    return args


def machine(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "postgres": row[0].split()[0] if row else "?",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # run the finally blocks: stop what we started


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, on_sigterm)
    args = parse_args(argv)
    began = time.monotonic()
    dsn = server_dsn()
    pm = postmaster_pid(dsn)
    results: dict[str, Any] = {
        "machine": machine(dsn),
        "settings": {
            "date": datetime.now(UTC).strftime("%Y-%m-%d"),
            "reps": args.reps,
            "messages": args.messages,
            "samples": args.samples,
            "publish_one": args.publish_one,
            "publish_batch": args.publish_batch,
            "procrastinate_concurrency": args.procrastinate_concurrency,
        },
        "workloads": {},
        "skipped": [],
    }
    if pm is None:
        results["skipped"].append("PostgreSQL CPU (postmaster.pid not readable)")
    with tempfile.TemporaryDirectory(prefix="race-") as tmp:
        # the RabbitMQ node starts when the first RabbitMQ contestant is set up
        shared = Shared(Path(tmp), StampSocket(Path(tmp) / "stamps.sock"), find_rabbitmq())
        try:
            for workload in args.workloads:
                log(f"== {workload}")
                cells = run_workload(workload, shared, args, pm)
                mark_best(
                    cells, "median_ms" if workload == "latency" else "per_s", workload == "latency"
                )
                results["workloads"][workload] = cells
            if args.sustained:
                log("== sustained")
                results["sustained"] = sustained(shared, args.sustained, pm)
        finally:
            if shared.rabbit is not None:
                shared.rabbit.close()
            shared.stamps.close()
        if shared.rabbit_error:
            results["skipped"].append(f"RabbitMQ ({shared.rabbit_error})")
    results["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    results["seconds_total"] = round(time.monotonic() - began, 1)
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
