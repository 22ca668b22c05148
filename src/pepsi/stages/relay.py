"""`pepsi-stage-relay-to-smarthost` and `pepsi-stage-relay-to-internet`: send the message on.

One attempt per run: to the smarthost, or to each recipient domain's MX
hosts in preference order (A/AAAA when there is no MX). The replies decide,
per recipient, what becomes of the message and which delivery status
notifications go to its sender, all written with the outcome
(`pepsi.mail.relay.delivery`). The worker keeps its SMTP connections for the next
message to the same host (`pepsi.mail.relay.outbound.Client`, one per stage).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pepsi.config import StageConfig
from pepsi.mail.ingress.policy import domain_of
from pepsi.mail.relay import delivery
from pepsi.mail.relay.attempt import Outgoing, Peer
from pepsi.mail.relay.delivery import Result
from pepsi.mail.relay.outbound import Client
from pepsi.mail.relay.slots import Slots
from pepsi.stage import Message, Needs, PermanentError, Split, stage
from pepsi.stages.mail_options import RelayOptions

if TYPE_CHECKING:
    from dns.resolver import Resolver


@dataclass(frozen=True)
class _Route:
    """What a relay stage's worker keeps between messages (built at its first)."""

    client: Client  # its open SMTP connections
    smarthost: Peer | None  # to_smarthost: the one peer, its secret read once
    resolver: Resolver | None  # to_internet: DNS answers cached for their TTL


# by stage and options: a worker runs one stage, but per-address settings (W-9) may give
# some messages another smarthost, port or TLS, each with its own connections
_ROUTES: dict[tuple[str, RelayOptions], _Route] = {}


@stage(Needs.BODY)
def to_smarthost(msg: Message) -> Split:
    _require_recipients(msg)
    options: RelayOptions = msg.options.builtin_options
    route = _route(msg.options)
    assert route.smarthost is not None
    outgoing = _outgoing(msg, msg.recipients, _data(msg))
    results = route.client.send(f"{options.host}:{options.port}", [route.smarthost], outgoing)
    return _outcome(msg, options, results)


@stage(Needs.BODY)
def to_internet(msg: Message) -> Split:
    _require_recipients(msg)
    options: RelayOptions = msg.options.builtin_options
    route = _route(msg.options)
    assert route.resolver is not None
    from pepsi.mail.relay import mx  # noqa: PLC0415  # dnspython: 55 ms of a worker's start

    by_domain: dict[str, list[str]] = defaultdict(list)
    for recipient in msg.recipients:
        by_domain[domain_of(recipient)].append(recipient)
    results: dict[str, Result] = {}
    data = _data(msg)
    for domain, recipients in by_domain.items():
        try:
            hops = mx.route(domain, route.resolver)
        except mx.RouteError as exc:
            code = 550 if exc.permanent else 0
            results.update({r: Result(code, str(exc), exc.status) for r in recipients})
            continue
        peers = [Peer(h.host, h.address, options.port, "may") for h in hops]
        results.update(route.client.send(domain, peers, _outgoing(msg, tuple(recipients), data)))
    return _outcome(msg, options, results)


def _require_recipients(msg: Message) -> None:
    if not msg.recipients:
        raise PermanentError("no recipients to deliver to (a message published without any)")


def _route(config: StageConfig) -> _Route:
    options: RelayOptions = config.builtin_options
    route = _ROUTES.get((config.name, options))
    if route is None:
        client = Client(
            helo=options.helo,
            connect_timeout=options.connect_timeout,
            slots=Slots(options.destination_concurrency),
        )
        smarthost = resolver = None
        if options.host is not None:
            secret = options.secret()
            login = (options.auth_user, secret) if options.auth_user and secret else None
            smarthost = Peer(
                options.host, options.host, options.port, options.tls, options.tls_ca_file, login
            )
        else:
            from pepsi.mail.relay import mx  # noqa: PLC0415  # only the internet relay's

            resolver = mx.make_resolver(options.nameservers)
        route = _ROUTES[(config.name, options)] = _Route(client, smarthost, resolver)
    return route


def _data(msg: Message) -> bytes:
    return (msg.header or b"") + b"\r\n" + (msg.body or b"")


def _outgoing(msg: Message, recipients: tuple[str, ...], data: bytes) -> Outgoing:
    return Outgoing(msg.sender or "", recipients, data, msg.properties.get("smtp", {}))


def _outcome(msg: Message, options: RelayOptions, results: dict[str, Result]) -> Split:
    context = delivery.Context.of(
        msg, dsn_stage=options.dsn_stage, delay_dsn_after=options.delay_dsn_after,
        hostname=options.helo,
    )  # fmt: skip
    split, state = delivery.decide(context, results)
    msg.state.update(state)
    return split
