"""What the handshake decides: admission, tune, heartbeats, server properties, logins.

Pure decisions, as RabbitMQ takes them (tests/unit/test_amqp_negotiation.py covers
them), and the `Gatekeeper` seam that decides logins and vhost access (the
server's `Catalogue` over PostgreSQL). `handshake.Handshake` asks them.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Any, Final, Protocol

from pamqp import commands

from pepsi import __version__
from pepsi.amqp.auth.permissions import Credentials, Permission
from pepsi.amqp.wire import protocol, replies


def connection_refusal(
    open_now: int, from_client: int, *, max_connections: int, client_limit: int
) -> str | None:
    """Why one more connection is refused (counts without it), None if it is not: a cap
    in all and per client address, so that idle sockets cannot exhaust the dispatcher's
    file descriptors or its loop before any login."""
    if open_now >= max_connections:
        return f"{open_now} connections open, the most [pepsi-amqp] MAX_CONNECTIONS allows"
    if from_client >= client_limit:
        return (
            f"{from_client} connections open from this address, the most "
            "[pepsi-amqp] CLIENT_CONNECTION_LIMIT allows"
        )
    return None


CONNECTION_CLASS: Final = 10
_TUNE_OK: Final = commands.Connection.TuneOk.index & 0xFFFF


def server_properties(version: str = __version__) -> dict[str, Any]:
    """connection.start's server-properties, shaped like RabbitMQ's."""
    return {
        "product": "Pepsi",
        "version": version,
        "platform": f"Python {platform.python_version()}",
        "information": "Pepsi, a durable message pipeline on PostgreSQL",
        "capabilities": {
            "publisher_confirms": True,
            "exchange_exchange_bindings": True,
            "basic.nack": True,
            "consumer_cancel_notify": True,
            "connection.blocked": True,
            "authentication_failure_close": True,
            "per_consumer_qos": True,
        },
    }


@dataclass(frozen=True)
class Tuned:
    """What connection.tune-ok settled (0 heartbeat: none)."""

    channel_max: int
    frame_max: int
    heartbeat: int


def negotiate_tune(
    offered_channel_max: int,
    offered_frame_max: int,
    channel_max: int,
    frame_max: int,
    heartbeat: int,
) -> Tuned:
    """The client's tune-ok against our tune; AMQPConnectionError 530 as RabbitMQ refuses.

    A 0 channel_max or frame_max ("no limit") means our offer: the server never runs
    unbounded. The heartbeat is the client's choice (RabbitMQ takes it as sent).
    """
    where = {"class_id": CONNECTION_CLASS, "method_id": _TUNE_OK}
    channel_max = channel_max or offered_channel_max
    frame_max = frame_max or offered_frame_max
    if channel_max > offered_channel_max:
        raise replies.AMQPConnectionError(
            replies.NOT_ALLOWED,
            f"negotiated channel_max = {channel_max} is higher than the maximum allowed "
            f"value ({offered_channel_max})",
            **where,
        )
    if frame_max < protocol.FRAME_MIN_SIZE:
        raise replies.AMQPConnectionError(
            replies.NOT_ALLOWED,
            f"frame_max={frame_max} < {protocol.FRAME_MIN_SIZE} min size",
            **where,
        )
    if frame_max > offered_frame_max:
        raise replies.AMQPConnectionError(
            replies.NOT_ALLOWED, f"frame_max={frame_max} > {offered_frame_max} max size", **where
        )
    return Tuned(channel_max, frame_max, heartbeat)


@dataclass(frozen=True)
class HeartbeatDue:
    """One heartbeat check: send one now? is the peer dead? when to check again."""

    send: bool
    dead: bool
    next_check: float


def heartbeat_due(
    now: float, interval: float, last_sent: float, last_received: float
) -> HeartbeatDue:
    """Send when nothing went out for interval/2; dead when nothing came in for 2 intervals.

    Any frame counts both ways, as in RabbitMQ: a busy connection sends no heartbeats.
    """
    if interval <= 0:
        raise ValueError("heartbeats are off")
    half, limit = interval / 2, 2 * interval
    dead = now - last_received >= limit
    send = not dead and now - last_sent >= half
    sent_at = now if send else last_sent
    return HeartbeatDue(send, dead, min(sent_at + half, last_received + limit))


class Gatekeeper(Protocol):
    """Who may log in and open which vhost (server.Catalogue reads PostgreSQL)."""

    async def login(self, credentials: Credentials, peer: str | None) -> str | None:
        """Why the login is refused (for the log), None if accepted."""
        ...

    async def vhost_permission(self, username: str, vhost: str) -> Permission:
        """The user's permission in `vhost`; AMQPConnectionError 530 if it may not open it."""
        ...


__all__ = [
    "Gatekeeper",
    "HeartbeatDue",
    "Tuned",
    "heartbeat_due",
    "negotiate_tune",
    "server_properties",
]
