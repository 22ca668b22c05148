"""What quorum replication costs a confirm: three nodes vs one, interleaved in one run.

    .venv/bin/python bench/cluster.py [--messages 2000] [--reps 3] [--dir DIR]

One node: the embedded default database (PostgreSQL 18, synchronous_commit
on). Three nodes: a `pepsi cluster` (the same PostgreSQL 18 under Patroni,
quorum commit `ANY 1` of the two standbys), created in a temporary directory
and destroyed afterwards unless --dir names an existing one. Both on this
machine, over loopback: the cost measured is the standby's round trip and
fsync, not a network's. Confirmed publishes, 1 KB bodies: one message per
call, and publish_many in batches of 100; reps alternate between the
targets. Prints one JSON document and a summary line.
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

from pepsi.cluster.harness import Cluster
from pepsi.cluster.layout import Layout
from pepsi.config import load_config
from pepsi.publishing import OutgoingMessage, Publisher

DB = "pepsi_bench_cluster"
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="an existing `pepsi cluster`")
    args = parser.parse_args()
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
