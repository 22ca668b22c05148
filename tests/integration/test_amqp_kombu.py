"""kombu and Celery against the AMQP listener (issue 16): the clients a Celery application
already uses, unchanged, on a real dispatcher and the test database."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from tests.integration.amqp_dispatcher import DispatcherThread, rows
from tests.integration.amqp_harness import PASSWORD, assert_no_server_bugs
from tests.scenarios.conftest import wait_until

Conn = psycopg.Connection[Any]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_server_bugs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    yield
    assert_no_server_bugs(caplog, tracebacks_only=True)


def url(broker: DispatcherThread) -> str:
    return f"amqp://alice:{PASSWORD}@127.0.0.1:{broker.port}//"


def test_a_kombu_simple_queue_with_confirms(broker: DispatcherThread, conn: Conn) -> None:
    with Connection(url(broker), transport_options={"confirm_publish": True}) as connection:
        queue = connection.SimpleQueue("kombu-simple")
        for i in range(5):
            queue.put({"n": i})  # returns once confirmed: the row is committed
        assert rows(conn, "kombu-simple") == {"pending": 5}
        got = []
        for _ in range(5):
            message = queue.get(timeout=10)
            got.append(message.payload)
            message.ack()
        queue.close()
    assert got == [{"n": i} for i in range(5)]  # in order, JSON as kombu wrote it
    # acks are written to the database with others, within 50 ms
    wait_until(lambda: rows(conn, "kombu-simple") == {}, what="the acked rows deleted")


def test_kombu_topic_exchange_consumer_requeue_and_reject(
    broker: DispatcherThread, conn: Conn
) -> None:
    exchange = Exchange("kombu-events", type="topic", durable=True)
    dead = Exchange("kombu-dead", type="fanout", durable=True)
    graveyard = Queue("kombu-graveyard", dead)
    queue = Queue(
        "kombu-orders",
        exchange,
        routing_key="order.*",
        queue_arguments={"x-queue-type": "quorum", "x-dead-letter-exchange": "kombu-dead"},
    )
    seen: list[tuple[str, bool]] = []

    def handle(body: dict[str, str], message: Any) -> None:
        seen.append((body["id"], bool(message.delivery_info["redelivered"])))
        if body["id"] == "b" and not message.delivery_info["redelivered"]:
            message.requeue()  # back to its place, redelivered
        elif body["id"] == "c":
            message.reject()  # no requeue: dead-lettered
        else:
            message.ack()

    with Connection(url(broker), transport_options={"confirm_publish": True}) as connection:
        producer = Producer(connection.channel(), exchange=exchange, serializer="json")
        for key, message_id in (("order.created", "a"), ("order.paid", "b"), ("order.lost", "c")):
            producer.publish({"id": message_id}, routing_key=key, declare=[queue, graveyard])
        producer.publish({"id": "x"}, routing_key="invoice.sent")  # matches no binding
        with Consumer(connection, queues=[queue], callbacks=[handle], prefetch_count=10):
            while len(seen) < 4:
                connection.drain_events(timeout=10)
        with connection.SimpleQueue(graveyard) as dead_letters:
            message = dead_letters.get(timeout=10)
            assert message.payload == {"id": "c"}
            assert message.headers["x-death"][0]["reason"] == "rejected"
            message.ack()
    assert sorted(seen) == [("a", False), ("b", False), ("b", True), ("c", False)]
    wait_until(lambda: rows(conn, "kombu-orders") == {}, what="the orders settled")
    wait_until(lambda: rows(conn, "kombu-graveyard") == {}, what="the dead letter acked")


def test_a_celery_worker_runs_tasks_and_returns_results(
    broker: DispatcherThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PEPSI_TEST_BROKER", url(broker))  # read by celery_app, here and there
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.integration.celery_app", "worker",
         "--pool", "solo", "--loglevel", "warning", "--events"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        from tests.integration import celery_app  # noqa: PLC0415  # needs the broker's URL

        celery_app.app.conf.broker_url = url(broker)  # if imported before, on another port
        results = [celery_app.add.delay(i, i) for i in range(20)]
        assert [r.get(timeout=60) for r in results] == [2 * i for i in range(20)]
        assert celery_app.flaky.delay("job").get(timeout=60) == "job after 1 retry"
    finally:
        worker.terminate()
        output, _ = worker.communicate(timeout=60)
    assert worker.returncode == 0, output
    assert "Traceback" not in output, output
