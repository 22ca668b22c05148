"""Q-1..Q-3 on a real cluster: a confirmed message survives the loss of any one node.

Three PostgreSQL nodes under Patroni with quorum commit (`ANY 1` of two
standbys, strict). The primary's host is killed (SIGKILL to Patroni and to
every PostgreSQL process) while a producer publishes confirmed messages one
at a time and a dispatcher runs a two-stage pipeline.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.cluster.harness import Cluster
from pepsi.cluster.layout import NODES
from pepsi.config import load_config
from pepsi.errors import DatabaseUnavailable, NotConfirmed
from pepsi.publishing import Publisher
from tests.cluster.conftest import fresh_database
from tests.scenarios.conftest import Pipeline, wait_until

pytestmark = pytest.mark.cluster

TWO_STAGES = (
    "[stage-a]\nHANDLER = tests.stages:effect\nNEXT = b\n[stage-b]\nHANDLER = tests.stages:effect\n"
)


class Producer(threading.Thread):
    """Publishes one message per call until stopped; a call ends only once confirmed.

    A call that fails (no primary, connection lost, not confirmed) is tried
    again with the same message id under dedup, so each call is one message.
    """

    def __init__(self, conf: Path, dsn: str) -> None:
        super().__init__(daemon=True)
        self.publisher = Publisher.connect(load_config(conf), dsn)
        self.confirmed: list[tuple[float, int]] = []  # (when, id)
        self.failures = 0
        self.halt = threading.Event()

    def run(self) -> None:
        number = 0
        while not self.halt.is_set():
            number += 1
            while True:
                try:
                    wid = self.publisher.publish("a", b"x", message_id=f"call-{number}", dedup=True)
                    break
                except (DatabaseUnavailable, NotConfirmed):
                    self.failures += 1
                    time.sleep(0.05)
            self.confirmed.append((time.monotonic(), wid))

    def stop(self) -> list[int]:
        self.halt.set()
        self.join(timeout=120)
        assert not self.is_alive(), "the producer did not finish its last publish"
        self.publisher.close()
        return [wid for _, wid in self.confirmed]


class QuorumWatch(threading.Thread):
    """Samples every reachable primary's synchronous_standby_names, and when it was promoted."""

    def __init__(self, cluster: Cluster, old_primary: str) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.old_primary = old_primary
        self.seen: set[str] = set()
        self.promoted_at: float | None = None  # a survivor answered as primary
        self.halt = threading.Event()

    def run(self) -> None:
        conns: dict[str, psycopg.Connection[Any]] = {}
        while not self.halt.is_set():
            for node in NODES:
                if node == self.old_primary:
                    continue
                try:
                    if node not in conns or conns[node].closed or conns[node].broken:
                        conns[node] = psycopg.connect(
                            self.cluster.layout.node_dsn(node, "postgres"),
                            autocommit=True,
                            connect_timeout=1,
                        )
                    row = (
                        conns[node]
                        .execute(
                            "SELECT pg_is_in_recovery(), current_setting('synchronous_standby_names')"
                        )
                        .fetchone()
                    )
                except psycopg.Error:
                    continue
                if row is not None and not row[0]:
                    self.seen.add(str(row[1]))
                    if self.promoted_at is None:
                        self.promoted_at = time.monotonic()
            time.sleep(0.05)
        for conn in conns.values():
            conn.close()


def test_kill_primary_under_load_loses_nothing(healthy: Cluster, tmp_path: Path) -> None:
    cluster = healthy
    dsn = fresh_database(cluster, "failover")
    pipeline = Pipeline(dsn, tmp_path)
    try:
        pipeline.configure(TWO_STAGES)
        pipeline.start()
        producer = Producer(pipeline.conf, dsn)
        producer.start()
        wait_until(lambda: len(producer.confirmed) >= 200, timeout=60, what="200 confirms")

        old = cluster.kill_primary()
        killed_at = time.monotonic()
        watch = QuorumWatch(cluster, old)
        watch.start()
        wait_until(lambda: watch.promoted_at is not None, timeout=90, what="a new primary")
        before = len(producer.confirmed)
        wait_until(
            lambda: len(producer.confirmed) >= before + 200, timeout=60, what="confirms again"
        )
        confirmed = producer.stop()
        watch.halt.set()
        watch.join()

        # The old primary comes back as a standby; what it had alone is rewound.
        cluster.start_node(old)
        cluster.wait_healthy()

        pipeline.db.close()  # it was on the old primary
        pipeline.db = psycopg.connect(dsn, autocommit=True)
        wait_until(pipeline.settled, timeout=120, what="the pipeline to drain")
        effects = pipeline.effects()
        done = {wid for (wid, stage) in effects if stage == "b"}
        lost = set(confirmed) - done
        unasked = done - set(confirmed)
        reruns = sum(n - 1 for n in effects.values() if n > 1)
        assert watch.promoted_at is not None
        after = [t for t, _ in producer.confirmed if t > killed_at]
        share = after[0] - watch.promoted_at if after else float("inf")
        print(
            f"killed {old}; new primary after {watch.promoted_at - killed_at:.1f}s; "
            f"first confirm {share:.2f}s later; {len(confirmed)} confirmed, "
            f"{producer.failures} failed tries, {reruns} stage re-runs; "
            f"quorum settings seen on primaries: {sorted(watch.seen)}"
        )
        assert not lost, f"{len(lost)} confirmed messages lost"
        assert not unasked, f"{len(unasked)} messages nobody confirmed were processed"
        assert len(confirmed) == len(set(confirmed)), "a call confirmed an id twice"
        assert pipeline.remaining() == 0
        # Never a primary without a synchronous standby rule, during or after failover.
        assert "" not in watch.seen, f"a primary ran without quorum: {watch.seen}"
        # Pepsi's share of the outage: the publisher's reconnect after promotion.
        assert share < 5.0, f"the first confirm came {share:.1f}s after the promotion"
    finally:
        pipeline.close()


def test_one_standby_down_publishing_does_not_stall(healthy: Cluster, tmp_path: Path) -> None:
    cluster = healthy
    dsn = fresh_database(cluster, "onestandby")
    leader = cluster.leader()
    standby = next(n for n in NODES if n != leader)
    cluster.kill(standby)
    pipeline = Pipeline(dsn, tmp_path)
    try:
        pipeline.configure(TWO_STAGES)
        started = time.monotonic()
        ids = pipeline.publish("a", count=1)
        for _ in range(99):  # confirmed one at a time: each waits for the remaining standby
            ids += pipeline.publish("a", count=1)
        took = time.monotonic() - started
        print(f"100 single confirmed publishes with {standby} down: {took:.2f}s")
        assert took < 30, f"publishing stalled: {took:.1f}s for 100 messages"
        assert pipeline.scalar("SELECT count(*) FROM pepsi.workqueue") == 100
    finally:
        pipeline.close()
        cluster.start_node(standby)
