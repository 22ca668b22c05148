"""Who may do what: relaying, connection admission, the AUTH slow-down. Pure.

Never an open relay: a recipient outside DOMAINS is taken only from a client
in RELAY_NETWORKS or one that authenticated (loopback is not trusted by
itself). Connections are capped in all and per client (an IPv6 client by its
/64, as the fair key counts it), so that one host cannot take every slot.
A client whose AUTH fails waits longer after each failure.
"""

from __future__ import annotations

import ipaddress
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pepsi.config.model import IPNetwork
from pepsi.mail.protocol import replies
from pepsi.mail.protocol.replies import Reply

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# AUTH failures: the first answer waits BASE, each further one twice as long, up to
# MAX; a client that has not failed for FORGET seconds starts over.
AUTH_DELAY_BASE = 0.5
AUTH_DELAY_MAX = 16.0
AUTH_FORGET = 600.0
AUTH_CLIENTS_KEPT = 10_000  # the oldest client is forgotten past this many


def peer_address(host: str | None) -> IPAddress | None:
    """The client's address (an IPv4-mapped IPv6 one as IPv4); None if not an IP peer."""
    if not host:
        return None
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def client_key(address: IPAddress | None) -> str:
    """Whom a connection counts against: the address, an IPv6 one by its /64 (D-3)."""
    if address is None:
        return "local"
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def in_networks(address: IPAddress | None, networks: Iterable[IPNetwork]) -> bool:
    return address is not None and any(address in network for network in networks)


def domain_of(address: str) -> str:
    """The domain of local@domain, lower case, without a trailing dot."""
    return address.rpartition("@")[2].lower().rstrip(".")


def serves(domain: str, domains: Iterable[str]) -> bool:
    """Whether mail for `domain` is accepted from anyone: listed, or under a `.parent` entry."""
    for entry in domains:
        if entry.startswith("."):
            if domain.endswith(entry):
                return True
        elif domain == entry:
            return True
    return False


def may_relay_to(recipient: str, domains: Iterable[str], *, trusted: bool) -> bool:
    """Whether this recipient is taken: a served domain, or a trusted or logged-in client."""
    return trusted or serves(domain_of(recipient), domains)


@dataclass
class Admission:
    """Open sessions, in all and per client: `admit` says who gets a session."""

    max_connections: int
    per_client: int  # 0: no per-client limit
    total: int = 0

    def __post_init__(self) -> None:
        self.by_client: Counter[str] = Counter()

    def admit(self, key: str, *, exempt: bool) -> Reply | None:
        """None (and the session is counted) or the 421 to close with."""
        if self.total >= self.max_connections:
            return replies.TOO_MANY_CONNECTIONS
        if not exempt and self.per_client and self.by_client[key] >= self.per_client:
            return replies.CLIENT_TOO_MANY
        self.total += 1
        self.by_client[key] += 1
        return None

    def release(self, key: str) -> None:
        self.total -= 1
        self.by_client[key] -= 1
        if self.by_client[key] <= 0:
            del self.by_client[key]


class AuthThrottle:
    """Recent AUTH failures per client, and how long its next answer waits."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.failures: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def delay(self, key: str) -> float:
        """Seconds to wait before answering this client's failed AUTH (after `failed`)."""
        count, _ = self._current(key)
        if count == 0:
            return 0.0
        return float(min(AUTH_DELAY_MAX, AUTH_DELAY_BASE * 2 ** (count - 1)))

    def failed(self, key: str) -> None:
        count, _ = self._current(key)
        self.failures[key] = (count + 1, self.clock())
        self.failures.move_to_end(key)
        while len(self.failures) > AUTH_CLIENTS_KEPT:
            self.failures.popitem(last=False)

    def succeeded(self, key: str) -> None:
        self.failures.pop(key, None)

    def _current(self, key: str) -> tuple[int, float]:
        count, last = self.failures.get(key, (0, 0.0))
        if count and self.clock() - last > AUTH_FORGET:
            del self.failures[key]
            return 0, 0.0
        return count, last
