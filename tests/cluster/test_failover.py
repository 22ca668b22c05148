"""Q-1..Q-3 on a real cluster: a confirmed message survives the loss of any one node.

Three PostgreSQL nodes under Patroni with quorum commit (`ANY 1` of two
standbys, strict). The primary's host is killed (SIGKILL to Patroni and to
every PostgreSQL process) while a producer publishes confirmed messages one
at a time and a dispatcher runs a two-stage pipeline.
"""

from __future__ import annotations

import smtplib
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pepsi.cluster.harness import Cluster
from pepsi.cluster.layout import NODES
from pepsi.config import load_config
from pepsi.errors import NotConfirmed
from pepsi.publishing import Publisher, Retry
from tests.cluster.conftest import fresh_database
from tests.scenarios.conftest import Pipeline, wait_until

pytestmark = pytest.mark.cluster

TWO_STAGES = (
    "[stage-a]\nHANDLER = tests.stages:effect\nNEXT = b\n[stage-b]\nHANDLER = tests.stages:effect\n"
)


class Producer(threading.Thread):
    """Publishes one message per call until stopped, each call with `retry=`.

    The publisher gives each message an id under dedup and tries a failed
    call again (no primary, connection lost, not confirmed) until confirmed,
    so each call is exactly one message (Q-3).
    """

    def __init__(self, conf: Path, dsn: str) -> None:
        super().__init__(daemon=True)
        self.publisher = Publisher.connect(load_config(conf), dsn, retry=Retry(deadline=120))
        self.confirmed: list[tuple[float, int]] = []  # (when, id)
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            wid = self.publisher.publish("a", b"x")
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
            f"{reruns} stage re-runs; "
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


def _visible(dsn: str, message_id: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pepsi.workqueue WHERE message_id = %s", [message_id]
        ).fetchone()
    return int(row[0]) if row else 0


def _sync_rep_waiters(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE wait_event = 'SyncRep' AND application_name = 'pepsi-publish'"
        ).fetchall()
    return [int(r[0]) for r in rows]


def test_both_standbys_down_nothing_is_confirmed(healthy: Cluster, tmp_path: Path) -> None:
    cluster = healthy
    dsn = fresh_database(cluster, "nostandby")
    conf = tmp_path / "pepsi.conf"
    conf.write_text(TWO_STAGES)
    leader = cluster.leader()
    standbys = [n for n in NODES if n != leader]
    for node in standbys:
        cluster.kill(node)
    publisher = Publisher.connect(load_config(conf), dsn)
    try:
        # A cancelled wait commits locally (PostgreSQL's WARNING): still NotConfirmed.
        # (First: a commit waiting for a standby holds the NOTIFY queue's lock,
        # so later publishes queue behind it on that lock, not on SyncRep.)
        outcome: list[BaseException | int] = []

        def waiting_publish() -> None:
            try:
                outcome.append(publisher.publish("a", b"x", message_id="cancelled", dedup=True))
            except NotConfirmed as exc:
                outcome.append(exc)

        waiter = threading.Thread(target=waiting_publish, daemon=True)
        waiter.start()
        pids = wait_until(lambda: _sync_rep_waiters(dsn), what="a publish waiting for a standby")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_cancel_backend(%s)", [pids[0]])
        waiter.join(timeout=30)
        assert len(outcome) == 1
        assert isinstance(outcome[0], NotConfirmed), f"a cancelled wait gave {outcome[0]!r}"

        # A deadline ends the wait by closing the connection: NotConfirmed, and
        # the row stays invisible (its commit still waits for a standby).
        started = time.monotonic()
        try:
            publisher.publish("a", b"x", message_id="timed-out", dedup=True, confirm_timeout=2)
        except NotConfirmed as exc:
            print(f"after {time.monotonic() - started:.1f}s: {exc}")
        else:
            raise AssertionError("a publish was confirmed with both standbys down")
        assert time.monotonic() - started < 10
        assert _visible(dsn, "timed-out") == 0

        # A standby comes back: the timed-out commit completes; publishing it
        # again under its message id gives that one row, not a second.
        cluster.start_node(standbys[0])
        wait_until(lambda: _visible(dsn, "timed-out") == 1, timeout=60, what="the commit")
        again = publisher.publish("a", b"x", message_id="timed-out", dedup=True, confirm_timeout=10)
        assert _visible(dsn, "timed-out") == 1
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT workqueue_id FROM pepsi.workqueue WHERE message_id = 'timed-out'"
            ).fetchone()
        assert row is not None
        assert row[0] == again
    finally:
        publisher.close()
        for node in standbys:
            cluster.start_node(node)


def test_smtp_gets_no_250_without_the_quorum(healthy: Cluster, tmp_path: Path) -> None:
    """M-1 on a cluster: the ingress's 250 comes after the quorum commit, never before."""
    from tests.mail_server import IngressProcess, message, queued_id  # noqa: PLC0415

    cluster = healthy
    dsn = fresh_database(cluster, "smtp")
    server = IngressProcess(dsn, tmp_path, "TIMEOUT = 3s").start()
    standbys = [n for n in NODES if n != cluster.leader()]
    try:
        with smtplib.SMTP(*server.smtp, timeout=60) as client:
            client.ehlo("client.test")
            client.mail("a@sender.org")
            client.rcpt("bob@example.com")
            code, reply = client.data(message("with quorum", Message_ID="<q1@sender.org>"))
            assert code == 250
            assert _visible(dsn, "<q1@sender.org>") == 1
            queued_id(reply)
            for node in standbys:
                cluster.kill(node)
            client.mail("a@sender.org")
            client.rcpt("bob@example.com")
            started = time.monotonic()
            code, reply = client.data(message("no quorum", Message_ID="<q2@sender.org>"))
            assert (code, reply[:5]) == (451, b"4.3.0")
            assert time.monotonic() - started < 30
        assert _visible(dsn, "<q2@sender.org>") == 0  # its commit still waits for a standby
    finally:
        server.close()
        for node in standbys:
            cluster.start_node(node)
