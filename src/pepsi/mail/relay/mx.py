"""Where mail for a domain goes (RFC 5321 §5): its MX hosts in preference order, on dnspython.

Hosts of equal preference are tried in a random order (load sharing, as
§5.1 asks); a domain without MX records is its own mail host (its A and
AAAA records); a null MX (RFC 7505) or a domain that does not exist is a
permanent failure, any other DNS trouble a temporary one. The name servers
are the system's unless NAMESERVERS says otherwise (`ADDRESS` or `ADDRESS:PORT`,
so that a test can run one on a loopback port).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import dns.exception
import dns.nameserver
import dns.resolver

DNS_TIMEOUT = 10.0  # seconds for one name's answer (all servers tried)


@dataclass(frozen=True)
class Hop:
    """One mail host to try: its name and one of its addresses."""

    host: str
    address: str
    preference: int


class RouteError(Exception):
    """No host to try; `permanent` says whether trying later could help."""

    def __init__(self, text: str, *, permanent: bool, status: str) -> None:
        super().__init__(text)
        self.permanent = permanent
        self.status = status


def make_resolver(
    nameservers: Sequence[tuple[str, int]] = (), timeout: float = DNS_TIMEOUT
) -> dns.resolver.Resolver:
    """The system's resolver, or one asking only `nameservers`; answers are cached (TTL)."""
    if nameservers:
        resolver = dns.resolver.Resolver(configure=False)
        resolver.nameservers = [
            dns.nameserver.Do53Nameserver(host, port) for host, port in nameservers
        ]
    else:
        resolver = dns.resolver.Resolver()
    resolver.lifetime = timeout
    resolver.cache = dns.resolver.Cache()
    return resolver


def route(domain: str, resolver: dns.resolver.Resolver) -> list[Hop]:
    """The hosts to try for `domain`, in order; RouteError if there is none."""
    try:
        answer = resolver.resolve(domain, "MX")
    except dns.resolver.NXDOMAIN:
        raise RouteError(
            f"domain {domain} does not exist", permanent=True, status="5.1.2"
        ) from None
    except dns.resolver.NoAnswer:
        return _addresses(domain, 0, resolver, implicit=True)  # its own mail host
    except dns.exception.DNSException as exc:
        raise RouteError(
            f"MX lookup for {domain} failed: {exc}", permanent=False, status="4.4.3"
        ) from None
    records = sorted(answer, key=lambda r: (r.preference, random.random()))  # noqa: S311
    if len(records) == 1 and records[0].exchange.to_text() == ".":
        raise RouteError(f"{domain} accepts no mail (null MX)", permanent=True, status="5.1.10")
    hops: list[Hop] = []
    errors: list[str] = []
    for record in records:
        host = record.exchange.to_text().rstrip(".")
        try:
            hops += _addresses(host, record.preference, resolver, implicit=False)
        except RouteError as exc:
            errors.append(str(exc))
    if not hops:
        raise RouteError("; ".join(errors), permanent=False, status="4.4.3")
    return hops


def _addresses(
    host: str, preference: int, resolver: dns.resolver.Resolver, *, implicit: bool
) -> list[Hop]:
    """A host's A and AAAA records; one kind failing is no failure if the other answers."""
    found: list[Hop] = []
    problems: list[str] = []
    exists = False
    for kind in ("A", "AAAA"):
        try:
            answer = resolver.resolve(host, kind)
        except dns.resolver.NXDOMAIN:
            break
        except dns.resolver.NoAnswer:
            exists = True
            continue
        except dns.exception.DNSException as exc:
            problems.append(f"{kind} lookup for {host} failed: {exc}")
            continue
        exists = True
        found += [Hop(host, record.to_text(), preference) for record in answer]
    if found:
        return found
    if problems:
        raise RouteError("; ".join(problems), permanent=False, status="4.4.3")
    if implicit:  # the domain itself, without MX: gone, or no address
        what = "has no MX and no address" if exists else "does not exist"
        raise RouteError(f"domain {host} {what}", permanent=True, status="5.1.2")
    raise RouteError(f"MX host {host} has no address", permanent=False, status="4.4.3")
