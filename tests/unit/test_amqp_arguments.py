"""Queue arguments, properties, redeclaration and names (model.arguments, queues, values)."""

from __future__ import annotations

import datetime as dt
import random
import re
from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pepsi.amqp.model.arguments import QueueArguments, parse_queue_arguments
from pepsi.amqp.model.queues import (
    QueueDeclaration,
    check_queue_name,
    check_queue_properties,
    check_queue_redeclare,
    declare_queue_name,
    generate_queue_name,
)
from pepsi.amqp.model.values import describe_value, field_type, value_key
from pepsi.amqp.wire.replies import (
    ACCESS_REFUSED,
    PRECONDITION_FAILED,
    RESOURCE_LOCKED,
    AMQPConnectionError,
    ChannelError,
    is_hard_error,
)

PREFIX = "invalid arg '{key}' for queue 'q' in vhost '/': "


def parse(**arguments: object) -> QueueArguments:
    return parse_queue_arguments(arguments, queue="q")


def refused(arguments: dict[str, object]) -> ChannelError:
    with pytest.raises(ChannelError) as caught:
        parse_queue_arguments(arguments, queue="q")
    assert caught.value.code == PRECONDITION_FAILED
    return caught.value


# -- replies ---------------------------------------------------------------------------


def test_reply_text_and_hardness() -> None:
    error = ChannelError(404, "no queue 'q' in vhost '/'", 50, 10)
    assert error.reply_text == "NOT_FOUND - no queue 'q' in vhost '/'"
    assert str(error) == error.reply_text
    assert (error.class_id, error.method_id) == (50, 10)
    assert AMQPConnectionError(530, "vhost").reply_text == "NOT_ALLOWED - vhost"
    assert ChannelError(999, "odd").reply_text == "odd"
    assert "ChannelError(404" in repr(error)
    assert not is_hard_error(406)
    assert not is_hard_error(200)
    assert is_hard_error(501)
    assert is_hard_error(540)


# -- defaults and every argument -------------------------------------------------------


def test_no_arguments() -> None:
    args = parse_queue_arguments(None, queue="q")
    assert args == QueueArguments()
    assert args.queue_type == "classic"
    assert args.overflow == "drop-head"
    assert dict(args.raw) == {}


def test_queue_type() -> None:
    assert parse(**{"x-queue-type": "quorum"}).queue_type == "quorum"
    assert parse(**{"x-queue-type": "classic"}).queue_type == "classic"
    assert parse(**{"x-queue-type": "undefined"}).queue_type == "classic"
    error = refused({"x-queue-type": "stream"})
    assert error.text.startswith(PREFIX.format(key="x-queue-type") + '"unsupported queue type')
    assert "stream" in error.text
    assert "Pepsi has classic and quorum queues" in error.text
    error = refused({"x-queue-type": "fancy"})
    assert error.text == PREFIX.format(key="x-queue-type") + "\"unsupported queue type 'fancy'\""
    error = refused({"x-queue-type": 1})
    assert error.text == PREFIX.format(key="x-queue-type") + "{unacceptable_type,signedint}"


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_max_length(queue_type: str) -> None:
    assert parse(**{"x-queue-type": queue_type, "x-max-length": 10}).max_length == 10
    base: dict[str, object] = {"x-queue-type": queue_type}
    key = PREFIX.format(key="x-max-length")
    assert refused({**base, "x-max-length": -1}).text == key + "{value_negative,-1}"
    assert refused({**base, "x-max-length": 0}).text == key + "{value_zero,0}"
    assert refused({**base, "x-max-length": "5"}).text == key + '"expected integer, got longstr"'
    assert refused({**base, "x-max-length": True}).text == key + '"expected integer, got bool"'
    assert refused({**base, "x-max-length": 1.5}).text == key + '"expected integer, got double"'


def test_max_length_bytes() -> None:
    assert parse(**{"x-max-length-bytes": 0}).max_length_bytes == 0
    assert parse(**{"x-max-length-bytes": 2**40}).max_length_bytes == 2**40
    key = PREFIX.format(key="x-max-length-bytes")
    assert refused({"x-max-length-bytes": -5}).text == key + "{value_negative,-5}"
    assert refused({"x-max-length-bytes": "1k"}).text == key + '"expected integer, got longstr"'


def test_overflow() -> None:
    for mode in ("drop-head", "reject-publish", "reject-publish-dlx"):
        assert parse(**{"x-overflow": mode}).overflow == mode
    key = PREFIX.format(key="x-overflow")
    assert refused({"x-overflow": "drop-tail"}).text == key + "invalid_overflow"
    assert refused({"x-overflow": 1}).text == key + "{unacceptable_type,signedint}"


def test_reject_publish_dlx_behaves_per_queue_type() -> None:
    quorum = parse(**{"x-queue-type": "quorum", "x-overflow": "reject-publish-dlx"})
    assert quorum.effective_overflow == "drop-head"  # RabbitMQ's quorum queue ignores it
    classic = parse(**{"x-overflow": "reject-publish-dlx"})
    assert classic.effective_overflow == "reject-publish"
    assert parse(**{"x-overflow": "reject-publish"}).effective_overflow == "reject-publish"


def test_message_ttl() -> None:
    assert parse(**{"x-message-ttl": 0}).message_ttl == 0
    assert parse(**{"x-message-ttl": 60000}).message_ttl == 60000
    key = PREFIX.format(key="x-message-ttl")
    assert refused({"x-message-ttl": -1}).text == key + "{value_negative,-1}"
    too_long = 315_360_000_001
    assert refused({"x-message-ttl": too_long}).text == key + f"{{value_too_large,{too_long}}}"
    assert refused({"x-message-ttl": "1s"}).text == key + '"expected integer, got longstr"'


def test_expires() -> None:
    assert parse(**{"x-expires": 1}).expires == 1
    key = PREFIX.format(key="x-expires")
    assert refused({"x-expires": 0}).text == key + "{value_zero,0}"
    assert refused({"x-expires": -3}).text == key + "{value_negative,-3}"
    assert refused({"x-expires": 2**40}).text == key + f"{{value_too_large,{2**40}}}"
    assert refused({"x-expires": Decimal(1)}).text == key + '"expected integer, got decimal"'


def test_dead_letter_exchange_and_routing_key() -> None:
    args = parse(**{"x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "dead"})
    assert (args.dead_letter_exchange, args.dead_letter_routing_key) == ("dlx", "dead")
    assert parse(**{"x-dead-letter-exchange": ""}).dead_letter_exchange == ""  # the default
    error = refused({"x-dead-letter-routing-key": "dead"})
    assert error.text == (
        PREFIX.format(key="x-dead-letter-routing-key") + "routing_key_but_no_dlx_defined"
    )
    # The channel checks the DLX's type first, in words of its own.
    error = refused({"x-dead-letter-exchange": 5, "x-expires": 0})
    assert error.text == (
        "invalid type 'signedint' for arg 'x-dead-letter-exchange' in queue 'q' in vhost '/'"
    )
    error = refused({"x-dead-letter-exchange": b"dlx"})
    assert error.text.startswith("invalid type 'binary' for arg 'x-dead-letter-exchange'")
    error = refused({"x-dead-letter-exchange": "d", "x-dead-letter-routing-key": ["k"]})
    assert error.text == PREFIX.format(key="x-dead-letter-routing-key") + (
        "{unacceptable_type,array}"
    )


def test_dead_letter_strategy_is_quorum_only() -> None:
    args = parse(**{"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once"})
    assert args.dead_letter_strategy == "at-least-once"
    error = refused({"x-queue-type": "quorum", "x-dead-letter-strategy": "sometimes"})
    assert error.text.endswith("invalid_dlx_strategy")
    error = refused({"x-dead-letter-strategy": "at-most-once"})
    assert error.text == (
        "invalid arg 'x-dead-letter-strategy' for queue 'q' in vhost '/' "
        "of queue type rabbit_classic_queue"
    )


def test_delivery_limit_is_quorum_only() -> None:
    assert parse(**{"x-queue-type": "quorum", "x-delivery-limit": 3}).delivery_limit == 3
    assert parse(**{"x-queue-type": "quorum", "x-delivery-limit": 0}).delivery_limit == 0
    error = refused({"x-queue-type": "quorum", "x-delivery-limit": -1})
    assert error.text == PREFIX.format(key="x-delivery-limit") + "{value_negative,-1}"
    error = refused({"x-queue-type": "quorum", "x-delivery-limit": "3"})
    assert error.text.endswith('"expected integer, got longstr"')
    error = refused({"x-delivery-limit": 3})
    assert error.text.endswith("of queue type rabbit_classic_queue")


def test_single_active_consumer() -> None:
    assert parse(**{"x-single-active-consumer": True}).single_active_consumer is True
    assert parse(**{"x-single-active-consumer": False}).single_active_consumer is False
    assert parse().single_active_consumer is False
    error = refused({"x-single-active-consumer": 1})
    assert error.text == PREFIX.format(key="x-single-active-consumer") + (
        "{unacceptable_type,signedint}"
    )
    error = refused({"x-single-active-consumer": "true"})
    assert error.text.endswith("{unacceptable_type,longstr}")


def test_arguments_of_another_queue_type_are_refused() -> None:
    error = refused({"x-queue-type": "quorum", "x-max-priority": 10})
    assert error.text == (
        "invalid arg 'x-max-priority' for queue 'q' in vhost '/' of queue type rabbit_quorum_queue"
    )
    error = refused({"x-max-age": "1D"})
    assert error.text.endswith("of queue type rabbit_classic_queue")
    error = refused({"x-queue-type": "quorum", "x-queue-mode": "lazy"})
    assert error.text.endswith("of queue type rabbit_quorum_queue")


def test_unknown_x_arguments_are_ignored() -> None:
    args = parse(**{"x-custom": "anything", "x-priority-whatever": 1, "other": [1, 2]})
    assert args == QueueArguments(raw=args.raw)
    assert args.ignored == ()
    assert dict(args.raw) == {"x-custom": "anything", "x-priority-whatever": 1, "other": [1, 2]}


def test_accepted_arguments_without_effect_are_listed() -> None:
    classic = parse(**{"x-max-priority": 10, "x-queue-mode": "lazy", "x-queue-version": 2})
    assert classic.ignored == ("x-queue-mode", "x-queue-version")
    assert classic.max_priority == 10  # issue 33: priorities count
    quorum = parse(
        **{
            "x-queue-type": "quorum",
            "x-quorum-initial-group-size": 3,
            "x-queue-leader-locator": "balanced",
            "x-max-in-memory-length": 0,
        }
    )
    assert quorum.ignored == (
        "x-quorum-initial-group-size",
        "x-queue-leader-locator",
        "x-max-in-memory-length",
    )


def test_no_effect_arguments_are_still_validated() -> None:
    assert refused({"x-max-priority": 256}).text.endswith("{max_value_exceeded,256}")
    assert refused({"x-max-priority": -1}).text.endswith("{value_negative,-1}")
    assert refused({"x-queue-mode": "eager"}).text.endswith("\"unsupported queue mode 'eager'\"")
    assert refused({"x-queue-version": 3}).text.endswith("\"unsupported queue version '3'\"")
    quorum: dict[str, object] = {"x-queue-type": "quorum"}
    error = refused({**quorum, "x-quorum-initial-group-size": 0})
    assert error.text.endswith("{value_zero,0}")
    error = refused({**quorum, "x-queue-leader-locator": "anywhere"})
    assert error.text.endswith("invalid_queue_locator_arg")


def test_first_error_in_rabbitmq_order() -> None:
    # x-expires is checked before x-max-length, whatever the table's order.
    error = refused({"x-max-length": -1, "x-expires": 0})
    assert "'x-expires'" in error.text


def test_queue_name_and_vhost_in_the_text() -> None:
    with pytest.raises(ChannelError) as caught:
        parse_queue_arguments({"x-max-length": -1}, queue="jobs", vhost="prod")
    assert caught.value.reply_text == (
        "PRECONDITION_FAILED - invalid arg 'x-max-length' for queue 'jobs' in vhost 'prod': "
        "{value_negative,-1}"
    )


# -- properties ------------------------------------------------------------------------


def test_quorum_queue_properties() -> None:
    check_queue_properties(QueueDeclaration("q"), "quorum")
    check_queue_properties(QueueDeclaration("q", durable=False, exclusive=True), "classic")
    cases = {
        QueueDeclaration("q", auto_delete=True): "auto-delete",
        QueueDeclaration("q", exclusive=True): "exclusive-owner",
        QueueDeclaration("q", durable=False): "non-durable",
    }
    for declaration, prop in cases.items():
        with pytest.raises(ChannelError) as caught:
            check_queue_properties(declaration, "quorum")
        assert caught.value.code == PRECONDITION_FAILED
        assert caught.value.text == f"invalid property '{prop}' for queue 'q' in vhost '/'"


# -- redeclaration ---------------------------------------------------------------------


def test_declaration_is_frozen() -> None:
    declaration = QueueDeclaration("q", arguments={"x-max-length": 5})
    with pytest.raises(TypeError):
        declaration.arguments["x-max-length"] = 6  # type: ignore[index]
    assert hash(declaration) == hash(QueueDeclaration("q"))


def test_redeclare_the_same_is_fine() -> None:
    first = QueueDeclaration("q", arguments={"x-max-length": 5, "x-custom": 1})
    again = QueueDeclaration("q", arguments={"x-max-length": 5})
    assert check_queue_redeclare(first, again) is None
    assert check_queue_redeclare(first, first) is None


def test_redeclare_argument_texts() -> None:
    first = QueueDeclaration("q", arguments={"x-max-length": 5})
    error = check_queue_redeclare(first, QueueDeclaration("q", arguments={"x-max-length": 10}))
    assert error is not None
    assert error.code == PRECONDITION_FAILED
    assert error.text == (
        "inequivalent arg 'x-max-length' for queue 'q' in vhost '/': received the value '10' "
        "of type 'signedint' but current is the value '5' of type 'signedint'"
    )
    error = check_queue_redeclare(first, QueueDeclaration("q"))
    assert error is not None
    assert error.text.endswith("received none but current is the value '5' of type 'signedint'")
    error = check_queue_redeclare(first, QueueDeclaration("q", arguments={"x-max-length": "5"}))
    assert error is not None
    assert "received the value '5' of type 'longstr'" in error.text


def test_redeclare_compares_type_class_not_python_equality() -> None:
    first = QueueDeclaration("q", arguments={"x-single-active-consumer": True})
    same = QueueDeclaration("q", arguments={"x-single-active-consumer": True})
    assert check_queue_redeclare(first, same) is None
    one = QueueDeclaration("q", arguments={"x-single-active-consumer": 1})
    assert check_queue_redeclare(first, one) is not None


def test_redeclare_queue_type() -> None:
    quorum = QueueDeclaration("q", arguments={"x-queue-type": "quorum"})
    error = check_queue_redeclare(quorum, QueueDeclaration("q"))
    assert error is not None
    assert error.text == (
        "inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received the value "
        "'classic' of type 'longstr' but current is the value 'quorum' of type 'longstr'"
    )
    classic = QueueDeclaration("q", arguments={"x-queue-type": "classic"})
    assert check_queue_redeclare(QueueDeclaration("q"), classic) is None
    assert check_queue_redeclare(classic, QueueDeclaration("q")) is None


def test_redeclare_compares_only_the_existing_types_arguments() -> None:
    quorum = QueueDeclaration("q", arguments={"x-queue-type": "quorum", "x-delivery-limit": 3})
    again = QueueDeclaration("q", arguments={"x-queue-type": "quorum", "x-delivery-limit": 4})
    error = check_queue_redeclare(quorum, again)
    assert error is not None
    assert "'x-delivery-limit'" in error.text
    # x-max-priority is not a quorum argument: never compared for a quorum queue.
    quorum_args = {"x-queue-type": "quorum", "x-delivery-limit": 3}
    extra = QueueDeclaration("q", arguments={**quorum_args, "x-max-priority": 2})
    assert check_queue_redeclare(quorum, extra) is None


def test_redeclare_durable_and_auto_delete() -> None:
    error = check_queue_redeclare(QueueDeclaration("q"), QueueDeclaration("q", durable=False))
    assert error is not None
    assert error.text == (
        "inequivalent arg 'durable' for queue 'q' in vhost '/': "
        "received 'false' but current is 'true'"
    )
    error = check_queue_redeclare(QueueDeclaration("q"), QueueDeclaration("q", auto_delete=True))
    assert error is not None
    assert error.text == (
        "inequivalent arg 'auto_delete' for queue 'q' in vhost '/': "
        "received 'true' but current is 'false'"
    )


def test_redeclare_exclusive() -> None:
    mine = QueueDeclaration("q", durable=False, exclusive=True)
    assert check_queue_redeclare(mine, mine) is None
    # An exclusive declare's durable flag counts as false.
    assert check_queue_redeclare(mine, QueueDeclaration("q", exclusive=True)) is None
    for requested, same in ((mine, False), (QueueDeclaration("q", durable=False), True)):
        error = check_queue_redeclare(mine, requested, same_connection=same)
        assert error is not None
        assert error.code == RESOURCE_LOCKED
        assert error.text.startswith(
            "cannot obtain exclusive access to locked queue 'q' in vhost '/'."
        )
    error = check_queue_redeclare(QueueDeclaration("q"), QueueDeclaration("q", exclusive=True))
    assert error is not None
    assert error.code == RESOURCE_LOCKED


# -- names -----------------------------------------------------------------------------


def test_generated_names_use_the_injected_random_source() -> None:
    name = generate_queue_name(random.Random(7).randbytes)
    assert name == generate_queue_name(random.Random(7).randbytes)
    assert re.fullmatch(r"amq\.gen-[A-Za-z0-9_-]{22}", name)
    assert generate_queue_name() != generate_queue_name()


def test_declare_name_empty_is_server_named() -> None:
    name = declare_queue_name("", randbytes=random.Random(1).randbytes)
    assert name.startswith("amq.gen-")
    assert declare_queue_name("", passive=True) == ""
    with pytest.raises(ChannelError) as caught:
        declare_queue_name("", {"x-queue-type": "quorum"})
    assert caught.value.code == PRECONDITION_FAILED
    assert caught.value.text == "Cannot declare a server-named queue for type rabbit_quorum_queue"


def test_declare_name_reserved_prefix() -> None:
    with pytest.raises(ChannelError) as caught:
        declare_queue_name("amq.x")
    assert caught.value.code == ACCESS_REFUSED
    assert caught.value.reply_text == (
        "ACCESS_REFUSED - queue name 'amq.x' contains reserved prefix 'amq.*'"
    )
    assert declare_queue_name("amq.gen-abc", passive=True) == "amq.gen-abc"
    assert declare_queue_name("amqx") == "amqx"


def test_declare_name_strips_cr_lf() -> None:
    assert declare_queue_name("jo\r\nbs") == "jobs"


def test_queue_name_length_in_bytes() -> None:
    check_queue_name("q" * 255)
    check_queue_name("é" * 127)  # 254 bytes
    for name in ("q" * 256, "é" * 128):
        with pytest.raises(ChannelError) as caught:
            check_queue_name(name)
        assert caught.value.code == PRECONDITION_FAILED
        assert "at most 255" in caught.value.text
    with pytest.raises(ChannelError):
        declare_queue_name("q" * 256)


# -- values ----------------------------------------------------------------------------


def test_field_types() -> None:
    cases: list[tuple[object, str]] = [
        (None, "void"),
        (True, "bool"),
        (1, "signedint"),
        (2**31, "long"),
        (-(2**31), "signedint"),
        (1.5, "double"),
        (Decimal("1.5"), "decimal"),
        ("s", "longstr"),
        (b"b", "binary"),
        (dt.datetime(2026, 1, 1, tzinfo=dt.UTC), "timestamp"),
        ({"k": 1}, "table"),
        ([1], "array"),
        (object(), "object"),
    ]
    for value, name in cases:
        assert field_type(value) == name


def test_describe_value() -> None:
    assert describe_value(5) == "the value '5' of type 'signedint'"
    assert describe_value(False) == "the value 'false' of type 'bool'"
    assert describe_value(b"x") == "the value 'x' of type 'binary'"
    assert describe_value(None) == "the value 'undefined' of type 'void'"
    assert describe_value(None, present=False) == "none"


@given(st.integers(), st.booleans())
def test_value_key_keeps_bools_and_integers_apart(number: int, flag: bool) -> None:
    assert value_key(number) != value_key(flag)
    assert value_key(number) != value_key(float(number))
    assert value_key(number) == value_key(int(str(number)))
