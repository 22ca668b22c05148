"""Queue declaration: properties, redeclaration and names, as RabbitMQ 3.x applies them.

- `check_queue_properties`: a quorum queue must be durable, not exclusive,
  not auto-delete.
- `check_queue_redeclare`: a second declare must match the first.
- `declare_queue_name` / `generate_queue_name` / `check_queue_name`: the
  name rules (255 bytes, the reserved `amq.` prefix, server-named queues).

The arguments themselves are validated in `arguments`.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from pepsi.amqp.model.arguments import (
    _ARGUMENTS_BY_TYPE,
    _TYPE_MODULES,
    QUORUM,
    STREAM,
    _requested_type,
)
from pepsi.amqp.model.values import _plain, argument_mismatch, inequivalent, resource
from pepsi.amqp.wire.replies import (
    ACCESS_REFUSED,
    PRECONDITION_FAILED,
    RESOURCE_LOCKED,
    ChannelError,
)

MAX_NAME_BYTES: Final = 255  # a shortstr
RESERVED_PREFIX: Final = "amq."
GENERATED_PREFIX: Final = "amq.gen-"


# -- properties and redeclaration ------------------------------------------------------


@dataclass(frozen=True)
class QueueDeclaration:
    """What a `queue.declare` asked for (or what the existing queue was declared with)."""

    name: str
    vhost: str = "/"
    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    arguments: Mapping[str, object] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", MappingProxyType(dict(self.arguments)))


def check_queue_properties(declaration: QueueDeclaration, queue_type: str) -> None:
    """A quorum queue must be durable, shared and kept: raise 406 as RabbitMQ does."""
    if queue_type != QUORUM:
        return
    what = resource("queue", declaration.name, declaration.vhost)
    # RabbitMQ's order: auto-delete, exclusive, then durability.
    for wrong, prop in (
        (declaration.auto_delete, "auto-delete"),
        (declaration.exclusive, "exclusive-owner"),
        (not declaration.durable or declaration.exclusive, "non-durable"),
    ):
        if wrong:
            raise ChannelError(PRECONDITION_FAILED, f"invalid property '{prop}' for {what}")


def _with_default_type(arguments: Mapping[str, object]) -> dict[str, object]:
    # RabbitMQ 3.13 writes the default type into a declare that names none.
    table = dict(arguments)
    table["x-queue-type"] = _requested_type(arguments)
    return table


def check_queue_redeclare(
    existing: QueueDeclaration, requested: QueueDeclaration, *, same_connection: bool = True
) -> ChannelError | None:
    """None when `requested` may redeclare `existing`, else the error to close the channel with.

    Exclusivity first (405 RESOURCE_LOCKED, as RabbitMQ: an exclusive queue
    belongs to the connection that declared it), then durable, auto_delete
    and the arguments of the existing queue's type (406). A durable flag on
    an exclusive declare counts as false, as in RabbitMQ. Arguments no queue
    type knows are not compared.
    """
    what = resource("queue", existing.name, existing.vhost)
    owner_matches = existing.exclusive == requested.exclusive and (
        not existing.exclusive or same_connection
    )
    if not owner_matches:
        return ChannelError(
            RESOURCE_LOCKED,
            f"cannot obtain exclusive access to locked {what}. It could be originally "
            "declared on another connection or the exclusive property value does not "
            "match that of the original declaration.",
        )
    durable = requested.durable and not requested.exclusive
    current_durable = existing.durable and not existing.exclusive
    for key, current, received in (
        ("durable", current_durable, durable),
        ("auto_delete", existing.auto_delete, requested.auto_delete),
    ):
        if current != received:
            return ChannelError(
                PRECONDITION_FAILED,
                inequivalent(key, what, f"'{_plain(received)}'", f"'{_plain(current)}'"),
            )
    old = _with_default_type(existing.arguments)
    new = _with_default_type(requested.arguments)
    old_type = old["x-queue-type"]
    for key in _ARGUMENTS_BY_TYPE.get(old_type if isinstance(old_type, str) else "", ()):
        if (error := argument_mismatch(key, what, old, new)) is not None:
            return error
    return None


# -- names -----------------------------------------------------------------------------


def generate_queue_name(randbytes: Callable[[int], bytes] = secrets.token_bytes) -> str:
    """A server-named queue: 'amq.gen-' and 22 URL-safe characters (128 random bits)."""
    return GENERATED_PREFIX + base64.urlsafe_b64encode(randbytes(16)).rstrip(b"=").decode()


def check_queue_name(name: str, vhost: str = "/") -> None:
    """Raise 406 if `name` cannot be a queue name: more than 255 bytes of UTF-8."""
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise ChannelError(
            PRECONDITION_FAILED,
            f"queue name '{name[:64]}...' in vhost '{vhost}' is too long: "
            f"{size} bytes, at most {MAX_NAME_BYTES}",
        )


def declare_queue_name(
    name: str,
    arguments: Mapping[str, object] | None = None,
    *,
    passive: bool = False,
    vhost: str = "/",
    randbytes: Callable[[int], bytes] = secrets.token_bytes,
) -> str:
    """The name a `queue.declare` acts on, or the ChannelError RabbitMQ would raise.

    CR and LF are removed, as RabbitMQ does. An empty name makes a
    server-named queue ('amq.gen-…'), which RabbitMQ refuses for quorum
    queues (406). A non-passive declare of a name starting with 'amq.' is
    refused with 403, even when the queue exists (a server-named queue is
    redeclared passively, or not at all).
    """
    name = name.replace("\r", "").replace("\n", "")
    check_queue_name(name, vhost)
    if not name:
        if passive:
            return name  # the caller answers 404 or uses the last declared queue
        queue_type = _requested_type(arguments or {})
        if queue_type in (QUORUM, STREAM):
            raise ChannelError(
                PRECONDITION_FAILED,
                f"Cannot declare a server-named queue for type {_TYPE_MODULES[str(queue_type)]}",
            )
        return generate_queue_name(randbytes)
    if not passive and name.startswith(RESERVED_PREFIX):
        raise ChannelError(ACCESS_REFUSED, f"queue name '{name}' contains reserved prefix 'amq.*'")
    return name
