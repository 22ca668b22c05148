"""`pepsi-stage-relay-to-smarthost` and `pepsi-stage-relay-to-internet`: send the message on.

One attempt per run: to the smarthost, or to each recipient domain's MX
hosts in preference order (A/AAAA when there is no MX). The replies decide,
per recipient, what becomes of the message and which delivery status
notifications go to its sender, all written with the outcome
(`pepsi.mail.delivery`). The worker keeps its SMTP connections for the next
message to the same host (`pepsi.mail.outbound.Client`, one per stage).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime

from dns.resolver import Resolver

from pepsi.config import StageConfig
from pepsi.mail import delivery, mx
from pepsi.mail.delivery import Result
from pepsi.mail.outbound import Client, Outgoing, Peer, Slots
from pepsi.stage import Message, Needs, PermanentError, Split, stage
from pepsi.stages.mail_options import RelayOptions

_CLIENTS: dict[str, Client] = {}  # by stage: a worker runs one stage, this is for tests
_RESOLVERS: dict[str, Resolver] = {}


@stage(Needs.BODY)
def to_smarthost(msg: Message) -> Split:
    _require_recipients(msg)
    options: RelayOptions = msg.options.builtin_options
    assert options.host is not None
    secret = options.secret()
    peer = Peer(
        options.host, options.host, options.port, options.tls, options.tls_ca_file,
        None if options.auth_user is None or secret is None else (options.auth_user, secret),
    )  # fmt: skip
    outgoing = _outgoing(msg, msg.recipients)
    results = _client(msg.options).send(f"{options.host}:{options.port}", [peer], outgoing)
    return _outcome(msg, options, results)


@stage(Needs.BODY)
def to_internet(msg: Message) -> Split:
    _require_recipients(msg)
    options: RelayOptions = msg.options.builtin_options
    resolver = _RESOLVERS.get(msg.options.name)
    if resolver is None:
        resolver = _RESOLVERS[msg.options.name] = mx.make_resolver(options.nameservers)
    by_domain: dict[str, list[str]] = defaultdict(list)
    for recipient in msg.recipients:
        by_domain[recipient.rpartition("@")[2].lower()].append(recipient)
    results: dict[str, Result] = {}
    client = _client(msg.options)
    for domain, recipients in by_domain.items():
        try:
            hops = mx.route(domain, resolver)
        except mx.RouteError as exc:
            code = 550 if exc.permanent else 0
            results.update({r: Result(code, str(exc), exc.status) for r in recipients})
            continue
        peers = [Peer(h.host, h.address, options.port, "may") for h in hops]
        results.update(client.send(domain, peers, _outgoing(msg, tuple(recipients))))
    return _outcome(msg, options, results)


def _require_recipients(msg: Message) -> None:
    if not msg.recipients:
        raise PermanentError("no recipients to deliver to (a message published without any)")


def _client(config: StageConfig) -> Client:
    client = _CLIENTS.get(config.name)
    if client is None:
        options: RelayOptions = config.builtin_options
        client = _CLIENTS[config.name] = Client(
            helo=options.helo,
            connect_timeout=options.connect_timeout,
            slots=Slots(options.destination_concurrency),
        )
    return client


def _outgoing(msg: Message, recipients: tuple[str, ...]) -> Outgoing:
    data = (msg.header or b"") + b"\r\n" + (msg.body or b"")
    return Outgoing(msg.sender or "", recipients, data, msg.properties.get("smtp", {}))


def _outcome(msg: Message, options: RelayOptions, results: dict[str, Result]) -> Split:
    context = delivery.Context(
        sender=msg.sender,
        recipients=msg.recipients,
        arrived=msg.arrived,
        smtp=msg.properties.get("smtp", {}),
        state=msg.state,
        header=msg.header or b"",
        body=msg.body or b"",
        dsn_stage=options.dsn_stage,
        delay_dsn_after=options.delay_dsn_after,
        hostname=options.helo,
        now=datetime.now(UTC),
    )
    split, state = delivery.decide(context, results)
    msg.state.update(state)
    return split
