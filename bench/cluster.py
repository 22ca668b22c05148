"""What quorum replication costs a confirm: three nodes vs one, interleaved in one run;
and, with --failover, Pepsi's own share of a failover.

    .venv/bin/python bench/cluster.py [--messages 2000] [--reps 3] [--dir DIR]
    .venv/bin/python bench/cluster.py --failover [--dir DIR]

One node: the embedded default database (PostgreSQL 18, synchronous_commit
on). Three nodes: a `pepsi cluster` (the same PostgreSQL 18 under Patroni,
quorum commit `ANY 1` of the two standbys), created in a temporary directory
and destroyed afterwards unless --dir names an existing one. Both on this
machine, over loopback: the cost measured is the standby's round trip and
fsync, not a network's. Confirmed publishes, 1 KB bodies: one message per
call, and publish_many in batches of 100; reps alternate between the
targets. Prints one JSON document and a summary line.

--failover: a dispatcher (its defaults: DB_ERROR_PAUSE 30 s) runs a two-stage
pipeline of 20 ms stages with 2 000 messages queued; the primary's host is
killed (SIGKILL of Patroni and PostgreSQL) while workers hold messages. Printed:
the promotion (after the kill), then from the promotion: the first message
finished on the new primary, the messages the workers held at the kill all
finished (Pepsi's share of the failover), and the queue drained (the rest of
the backlog's own time besides).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from common import scratch_database

from pepsi.cluster.harness import Cluster
from pepsi.cluster.layout import NODES, Layout
from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher

DB = "pepsi_bench_cluster"
HERE = Path(__file__).resolve().parent
BODY = b"x" * 1024
CONF = "[stage-inbound]\nHANDLER = bench_stages:noop\n"


def rate(dsn: str, conf: Path, messages: int, batch: int) -> float:
    """Confirmed messages per second publishing `messages` in calls of `batch`."""
    with Publisher(load_config(conf), dsn) as publisher:
        publisher.publish("inbound", BODY)  # warm: a pooled connection, plans prepared
        one = OutgoingMessage("inbound", BODY)
        start = time.perf_counter()
        if batch == 1:
            for _ in range(messages):
                publisher.publish("inbound", BODY)
        else:
            for _ in range(messages // batch):
                publisher.publish_many([one] * batch)
        return messages / (time.perf_counter() - start)


FAILOVER_CONF = (
    "[stage-a]\nHANDLER = bench_stages:slow\nNEXT = b\n[stage-b]\nHANDLER = bench_stages:slow\n"
)


def promoted(cluster: Cluster, old: str) -> bool:
    """Whether a survivor answers as a primary."""
    for node in NODES:
        if node == old:
            continue
        try:
            with psycopg.connect(cluster.layout.node_dsn(node, "postgres"), connect_timeout=1) as c:
                row = c.execute("SELECT pg_is_in_recovery()").fetchone()
        except psycopg.Error:
            continue
        if row is not None and not row[0]:
            return True
    return False


def queue(dsn: str) -> int | None:
    """The rows left on the primary; None while there is none."""
    try:
        with psycopg.connect(dsn, connect_timeout=1, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pepsi.workqueue").fetchone()
    except psycopg.Error:
        return None
    return int(row[0]) if row else None


def gone(dsn: str, ids: list[int]) -> bool:
    """Whether none of `ids` is left on the primary (False while there is none)."""
    try:
        with psycopg.connect(dsn, connect_timeout=1, autocommit=True) as conn:
            row = conn.execute(
                "SELECT NOT EXISTS (SELECT 1 FROM pepsi.workqueue WHERE workqueue_id = ANY(%s))",
                (ids,),
            ).fetchone()
    except psycopg.Error:
        return False
    return bool(row and row[0])


def failover(cluster: Cluster, tmp: Path) -> dict[str, float]:
    dsn = scratch_database(DB, cluster.layout.dsn("postgres"))
    conf = tmp / "failover.conf"
    conf.write_text(FAILOVER_CONF)
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PEPSI_DSN": dsn, "PYTHONPATH": path}
    log = tmp / "dispatch.log"
    with log.open("wb") as out:
        dispatcher = subprocess.Popen(
            [sys.executable, "-m", "pepsi", "-c", str(conf), "dispatch", "serve"],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    try:
        with Publisher(load_config(conf), dsn) as publisher:
            publisher.publish_many([OutgoingMessage("a", b"x")] * 2000)
        while (left := queue(dsn)) is None or left > 1900:  # in flight, a backlog behind
            time.sleep(0.05)
        with psycopg.connect(dsn, autocommit=True) as conn:  # what workers hold at the kill
            held = [int(r[0]) for r in conn.execute(
                "SELECT workqueue_id FROM pepsi.workqueue WHERE status = 'running'"
            )]  # fmt: skip
        old = cluster.kill_primary()
        killed = time.monotonic()
        while not promoted(cluster, old):
            time.sleep(0.05)
        promotion = time.monotonic()
        first_done: float | None = None
        held_done: float | None = None
        start_left: int | None = None
        while True:
            if held_done is None and gone(dsn, held):
                held_done = time.monotonic()
            left = queue(dsn)
            if left is not None:
                start_left = left if start_left is None else start_left
                if first_done is None and left < start_left:
                    first_done = time.monotonic()
                if left == 0:
                    break
            time.sleep(0.05)
        drained = time.monotonic()
    finally:
        dispatcher.send_signal(signal.SIGTERM)
        dispatcher.wait(60)
    return {
        "promotion_after_kill_s": round(promotion - killed, 2),
        "first_finished_after_promotion_s": round((first_done or drained) - promotion, 2),
        "held_at_kill": float(len(held)),
        "held_finished_after_promotion_s": round((held_done or drained) - promotion, 2),
        "drained_after_promotion_s": round(drained - promotion, 2),
        "left_at_promotion": float(start_left or 0),
        "paused_30s_lines": float(log.read_text().count("paused 30s")),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="an existing `pepsi cluster`")
    parser.add_argument(
        "--failover", action="store_true", help="measure Pepsi's share of a failover instead"
    )
    args = parser.parse_args()
    if args.failover:
        with tempfile.TemporaryDirectory() as tmp:
            if args.dir is not None:
                cluster = Cluster.open(args.dir)
                cluster.start()
            else:
                cluster = Cluster(Layout(Path(tmp) / "cluster", 54700))
                cluster.create()
                cluster.start()
            try:
                result = failover(cluster, Path(tmp))
            finally:
                if args.dir is None:
                    cluster.destroy()
        print(json.dumps(result, indent=2))
        print(
            f"SUMMARY failover: new primary {result['promotion_after_kill_s']}s after the kill; "
            f"then the first message finished after {result['first_finished_after_promotion_s']}s, "
            f"the {result['held_at_kill']:.0f} held at the kill after "
            f"{result['held_finished_after_promotion_s']}s, "
            f"and the queue ({result['left_at_promotion']:.0f} left) drained after "
            f"{result['drained_after_promotion_s']}s"
        )
        return 0
    one_node = scratch_database(DB)
    with tempfile.TemporaryDirectory() as tmp:
        if args.dir is not None:
            cluster = Cluster.open(args.dir)
            cluster.start()
            made = False
        else:
            cluster = Cluster(Layout(Path(tmp) / "cluster", 54700))
            cluster.create()
            cluster.start()
            made = True
        try:
            three_nodes = scratch_database(DB, cluster.layout.dsn("postgres"))
            conf = Path(tmp) / "pepsi.conf"
            conf.write_text(CONF)
            results: dict[str, list[float]] = {}
            for _ in range(args.reps):  # interleaved: the machine's drift hits both
                for batch in (1, 100):
                    for name, dsn in (("one_node", one_node), ("three_nodes", three_nodes)):
                        key = f"{name}_batch_{batch}"
                        results.setdefault(key, []).append(
                            round(rate(dsn, conf, args.messages, batch))
                        )
        finally:
            if made:
                cluster.destroy()
    median = {key: statistics.median(values) for key, values in results.items()}
    print(json.dumps({"runs": results, "median": median}, indent=2))
    single = median["three_nodes_batch_1"] / median["one_node_batch_1"]
    batched = median["three_nodes_batch_100"] / median["one_node_batch_100"]
    print(
        f"SUMMARY confirmed publishes, 3-node quorum vs 1 node: single "
        f"{median['three_nodes_batch_1']:.0f} vs {median['one_node_batch_1']:.0f} msg/s "
        f"(x{single:.2f}); batch 100 {median['three_nodes_batch_100']:.0f} vs "
        f"{median['one_node_batch_100']:.0f} msg/s (x{batched:.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
