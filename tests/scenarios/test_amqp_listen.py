"""A real dispatcher serving AMQP on `[pepsi-amqp] LISTEN`, reached with pika."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

import pika
import pika.exceptions
import pytest

from pepsi.admin.accounts import amqp_users
from tests.scenarios.conftest import Pipeline, wait_until

STAGES = "[stage-a]\nHANDLER = tests.stages:noop\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_dispatcher_serves_amqp_on_listen(pipeline: Pipeline) -> None:
    amqp_users.add_user(pipeline.db, "app", "app-secret")
    amqp_users.set_permissions(pipeline.db, "app", ".*", ".*", ".*")
    port = free_port()
    pipeline.configure(STAGES + f"[pepsi-amqp]\nLISTEN = 127.0.0.1:{port}\nHEARTBEAT = 5\n")
    dispatcher = pipeline.start()
    wait_until(lambda: f"amqp listening on 127.0.0.1:{port}" in dispatcher.log, what="the listener")
    parameters = pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("app", "app-secret")
    )
    connection = pika.BlockingConnection(parameters)
    channel = connection.channel()
    assert channel.is_open
    channel.queue_declare("orders")  # the broker: a queue is a stage
    channel.confirm_delivery()
    channel.basic_publish("", "orders", b"confirmed")  # acked after its commit
    stored = pipeline.db.execute(
        "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'amqp:/:orders'"
    ).fetchone()
    assert stored == (1,)
    got: list[bytes] = []  # a consumer, fed by this dispatcher's claim
    channel.basic_consume(
        "orders", lambda ch, m, p, body: (got.append(body), ch.basic_ack(m.delivery_tag))
    )
    wait_until(lambda: connection.process_data_events(time_limit=0.05) or got, what="the delivery")
    assert got == [b"confirmed"]
    wait_until(lambda: pipeline.db.execute(
        "SELECT count(*) FROM pepsi.workqueue WHERE stage = 'amqp:/:orders'"
    ).fetchone() == (0,), what="the ack to delete the row")  # fmt: skip
    assert connection.channel().queue_delete("orders").method.message_count == 0
    # the claim loop is unaffected: a message still goes through the pipeline
    pipeline.publish("a")
    wait_until(pipeline.settled, what="the message to finish")
    connection.close()
    assert dispatcher.stop() == 0
    assert "Traceback" not in dispatcher.log
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_listen_address_in_use_is_a_one_line_configuration_error(pipeline: Pipeline) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        pipeline.configure(STAGES + f"[pepsi-amqp]\nLISTEN = 127.0.0.1:{port}\n")
        dispatcher = pipeline.start()
        assert dispatcher.proc.wait(timeout=30) == 1
    assert f"[pepsi-amqp] LISTEN: cannot listen on 127.0.0.1:{port}" in dispatcher.log
    assert "Traceback" not in dispatcher.log


def test_the_pipeline_and_the_broker_are_one_system(pipeline: Pipeline) -> None:
    """An AMQP publish enters a stage of pepsi.conf ([pepsi-amqp] STAGES); the stage's
    NEXT is an AMQP queue, whose consumer gets the message with its properties."""
    amqp_users.add_user(pipeline.db, "app", "app-secret")
    amqp_users.set_permissions(pipeline.db, "app", ".*", ".*", ".*")
    port = free_port()
    pipeline.configure(
        "[stage-validate]\nHANDLER = tests.stages:noop\nNEXT = amqp:done\n"
        f"[pepsi-amqp]\nLISTEN = 127.0.0.1:{port}\nSTAGES = validate\n"
    )
    dispatcher = pipeline.start()
    wait_until(lambda: f"amqp listening on 127.0.0.1:{port}" in dispatcher.log, what="listener")
    connection = pika.BlockingConnection(
        pika.ConnectionParameters(
            "127.0.0.1", port, credentials=pika.PlainCredentials("app", "app-secret")
        )
    )
    channel = connection.channel()
    assert channel.queue_declare("validate", passive=True)  # declared by the dispatcher
    channel.queue_declare("done")
    channel.confirm_delivery()
    channel.basic_publish(
        "", "validate", b"order 1", pika.BasicProperties(message_id="o-1", headers={"n": 1})
    )
    got: list[tuple[Any, Any, bytes]] = []
    channel.basic_consume("done", lambda ch, m, p, b: got.append((m, p, b)), auto_ack=True)
    wait_until(lambda: connection.process_data_events(time_limit=0.05) or got, what="delivery")
    method, props, body = got[0]
    assert body == b"order 1"
    assert (method.exchange, method.routing_key) == ("", "validate")
    assert props.message_id == "o-1"  # the stored header, byte for byte
    assert props.headers == {"n": 1}
    # a message published by a Python producer into the stage reaches the queue too
    pipeline.publish("validate", body=b"from python", message_id="p-1", content_type="text/plain")
    wait_until(lambda: connection.process_data_events(time_limit=0.05) or len(got) > 1,
               what="the second delivery")  # fmt: skip
    method, props, body = got[1]
    assert body == b"from python"
    assert (props.message_id, props.content_type, props.delivery_mode) == ("p-1", "text/plain", 2)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="403"):
        channel.basic_get("validate")  # the stage's workers take its messages
    connection.close()
    assert dispatcher.stop() == 0
    assert "Traceback" not in dispatcher.log


def test_a_restart_of_the_broker_deletes_non_durable_and_exclusive_queues(
    pipeline: Pipeline,
) -> None:
    """As RabbitMQ (and the reliability lesson's restart section): after a restart, a
    non-durable queue is gone (a passive declare: 404), and so is an exclusive one; a
    durable queue keeps its messages, transient ones too (stronger than RabbitMQ's
    classic queues: docs/amqp.md)."""
    amqp_users.add_user(pipeline.db, "app", "app-secret")
    amqp_users.set_permissions(pipeline.db, "app", ".*", ".*", ".*")
    port = free_port()
    pipeline.configure(STAGES + f"[pepsi-amqp]\nLISTEN = 127.0.0.1:{port}\n")
    parameters = pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("app", "app-secret")
    )

    def listening(dispatcher: Any) -> None:
        wait_until(lambda: f"amqp listening on 127.0.0.1:{port}" in dispatcher.log, what="AMQP")

    first = pipeline.start()
    listening(first)
    connection = pika.BlockingConnection(parameters)
    channel = connection.channel()
    channel.confirm_delivery()
    channel.queue_declare("kept", durable=True)
    channel.queue_declare("fleeting", durable=False)
    channel.queue_declare("mine", durable=True, exclusive=True)
    for queue in ("kept", "fleeting"):
        channel.basic_publish("", queue, b"persistent", pika.BasicProperties(delivery_mode=2))
        channel.basic_publish("", queue, b"transient", pika.BasicProperties(delivery_mode=1))
    assert first.stop() == 0  # the broker goes while the client is still connected
    with contextlib.suppress(pika.exceptions.AMQPError):
        connection.process_data_events(time_limit=1)  # the server's connection.close
    if connection.is_open:
        connection.close()
    second = pipeline.start()
    listening(second)
    assert "transient queue 'fleeting' in '/' deleted at start (2 messages)" in second.log
    with pika.BlockingConnection(parameters) as again:
        channel = again.channel()
        assert channel.queue_declare("kept", durable=True, passive=True).method.message_count == 2
        for queue in ("fleeting", "mine"):
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as gone:
                channel.queue_declare(queue, passive=True)
            assert gone.value.reply_code == 404
            channel = again.channel()
    assert second.stop() == 0


def test_an_amqp_publish_into_a_stage_obeys_its_max_length(
    pipeline: Pipeline, tmp_path: Any
) -> None:
    """[pepsi-amqp] STAGES: the stage's MAX_LENGTH (reject-publish) refuses an AMQP publish
    as any other (a nack), and its OVERFLOW = drop-head pushes the oldest out."""
    amqp_users.add_user(pipeline.db, "app", "app-secret")
    amqp_users.set_permissions(pipeline.db, "app", ".*", ".*", ".*")
    port = free_port()
    # the gate is closed: the stages' workers refuse to start, and the stages rest
    # START_COOLDOWN after that; their messages wait, pending, meanwhile
    pipeline.extra_env["PEPSI_TEST_GATE"] = str(tmp_path / "gate")
    pipeline.configure(
        "[stage-held]\nHANDLER = tests.gate_stage:run\nMAX_LENGTH = 2\n"
        "[stage-rolling]\nHANDLER = tests.gate_stage:run\nMAX_LENGTH = 2\n"
        "OVERFLOW = drop-head\n"
        f"[pepsi-amqp]\nLISTEN = 127.0.0.1:{port}\nSTAGES = held, rolling\n",
        START_COOLDOWN="60s",
    )
    dispatcher = pipeline.start()
    wait_until(lambda: f"amqp listening on 127.0.0.1:{port}" in dispatcher.log, what="listener")
    parameters = pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("app", "app-secret")
    )

    def pending(stage: str) -> list[bytes]:
        rows = pipeline.db.execute(
            "SELECT b.body FROM pepsi.workqueue w JOIN pepsi.workqueue_body b USING (body_id)"
            " WHERE w.stage = %s AND w.status = 'pending' ORDER BY w.workqueue_id",
            (stage,),
        ).fetchall()
        return [bytes(r[0]) for r in rows]

    with pika.BlockingConnection(parameters) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish("", "held", b"0")
        channel.basic_publish("", "rolling", b"0")
        for stage in ("held", "rolling"):  # claimed, refused, back to pending; resting now
            wait_until(lambda s=stage: f"stage {s}: worker pid" in dispatcher.log
                       and pending(s) == [b"0"], what=f"{stage} to rest")  # fmt: skip
        channel.basic_publish("", "held", b"1")
        channel.basic_publish("", "rolling", b"1")
        with pytest.raises(pika.exceptions.NackError):
            channel.basic_publish("", "held", b"2")  # full: refused, as a Python publish is
        channel.basic_publish("", "rolling", b"2")  # drop-head: 0 goes
    assert pending("held") == [b"0", b"1"]
    assert pending("rolling") == [b"1", b"2"]
    assert dispatcher.stop() == 0


def test_a_peers_text_cannot_forge_a_line_of_the_dispatchers_log(pipeline: Pipeline) -> None:
    """Issue 34, finding 9: an AMQP mechanism name with a newline wrote a fake
    `CRITICAL … database wiped by admin` line into the dispatcher's log. Every message
    is written on one line now, its control characters escaped."""
    from pamqp import commands  # noqa: PLC0415

    from pepsi.amqp.wire import methods, protocol  # noqa: PLC0415
    from tests.integration.test_amqp_connection import Raw  # noqa: PLC0415

    port = free_port()
    pipeline.configure(STAGES + f"[pepsi-amqp]\nLISTEN = 127.0.0.1:{port}\n")
    dispatcher = pipeline.start()
    wait_until(lambda: f"amqp listening on 127.0.0.1:{port}" in dispatcher.log, what="AMQP")
    forged = "PLAIN\n2026-12-05 06:00:00,000 CRITICAL pepsi.dispatch: database wiped by admin"
    client = Raw(port)
    try:
        client.send(protocol.PROTOCOL_HEADER)
        client.expect(commands.Connection.Start)
        client.method(0, methods.build_method(
            commands.Connection.StartOk, client_properties={"product": "raw"},
            mechanism=forged, response=b"\0x\0y", locale="en_US",
        ))  # fmt: skip
        assert client.closed_within(10)
    finally:
        client.close()
    assert dispatcher.stop() == 0
    lines = dispatcher.log.splitlines()
    assert not [line for line in lines if line.startswith("2026-12-05 06:00:00,000 CRITICAL")]
    assert any("PLAIN\\n2026-12-05 06:00:00,000 CRITICAL" in line for line in lines), lines


def test_message_priority_as_rabbitmq_classic_queues_have_it(pipeline: Pipeline) -> None:
    """Issue 33: `x-max-priority` on declare, `priority` in the properties: higher
    first, FIFO within a priority, a priority over the queue's maximum counted as the
    maximum; a queue declared without it keeps publish order. Consumed with prefetch
    1 from a real dispatcher's claim, and with basic.get."""
    amqp_users.add_user(pipeline.db, "app", "app-secret")
    amqp_users.set_permissions(pipeline.db, "app", ".*", ".*", ".*")
    port = free_port()
    pipeline.configure(STAGES + f"[pepsi-amqp]\nLISTEN = 127.0.0.1:{port}\n")
    dispatcher = pipeline.start()
    wait_until(lambda: f"amqp listening on 127.0.0.1:{port}" in dispatcher.log, what="the listener")
    parameters = pika.ConnectionParameters(
        "127.0.0.1", port, credentials=pika.PlainCredentials("app", "app-secret")
    )
    with pika.BlockingConnection(parameters) as connection:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.queue_declare("ranked", arguments={"x-max-priority": 10})
        channel.queue_declare("plain")
        sent = [("p1", 1), ("none", None), ("p5", 5), ("p20", 20), ("p5b", 5), ("p10", 10)]
        for queue in ("ranked", "plain"):
            for body, priority in sent:
                channel.basic_publish(
                    "", queue, body.encode(), pika.BasicProperties(priority=priority)
                )
        got: list[bytes] = []
        channel.basic_qos(prefetch_count=1)
        channel.basic_consume(
            "ranked", lambda ch, m, p, body: (got.append(body), ch.basic_ack(m.delivery_tag))
        )
        wait_until(
            lambda: connection.process_data_events(time_limit=0.05) or len(got) == len(sent),
            what="the deliveries",
        )
        # 20 counts as the queue's 10, and came before p10: FIFO within a priority
        assert got == [b"p20", b"p10", b"p5", b"p5b", b"p1", b"none"]
        fetched = []
        while (method := channel.basic_get("plain", auto_ack=True))[0] is not None:
            fetched.append(method[2])
        assert fetched == [body.encode() for body, _ in sent]  # no x-max-priority: in order
        channel.queue_declare("ranked-get", arguments={"x-max-priority": 10})
        for body, priority in sent:
            properties = pika.BasicProperties(priority=priority)
            channel.basic_publish("", "ranked-get", body.encode(), properties)
        fetched = []
        while (method := channel.basic_get("ranked-get", auto_ack=True))[0] is not None:
            fetched.append(method[2])
        assert fetched == [b"p20", b"p10", b"p5", b"p5b", b"p1", b"none"]
    assert dispatcher.stop() == 0
