"""The mail built-ins' options: relays, DKIM signing, SRS, the bounce's reports. Pure.

Parsed with the configuration, in every program that reads it: no file is
read here. A key file or secret is checked when a worker of the stage starts
(`check_at_start`), and a worker that cannot read it refuses to run (78), so
that the queue waits for the fix instead of each message failing (W-3).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pepsi.config import values as v
from pepsi.config.values import stage_ref

TLS_MODES = ("none", "starttls", "implicit")
DEFAULT_DKIM_HEADERS = (
    "from", "reply-to", "subject", "date", "to", "cc", "message-id", "in-reply-to",
    "references", "mime-version", "content-type", "content-transfer-encoding", "list-id",
)  # fmt: skip
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_HEADER_NAME = re.compile(r"[!-9;-~]+")


class StartError(ValueError):
    """What a worker of the stage cannot use (a key or secret file); `key` names its key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(problem)
        self.key = key


def read_secret(key: str, path: Path) -> bytes:
    """A secret or key file's content; StartError if it cannot be read or is empty."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise StartError(key, f"cannot read {path}: {exc.strerror}") from None
    if not data.strip():
        raise StartError(key, f"{path} is empty")
    return data


@dataclass(frozen=True)
class RelayOptions:
    """pepsi-stage-relay-to-smarthost (`host` set) and pepsi-stage-relay-to-internet."""

    host: str | None = None  # the smarthost; None: the recipients' MX hosts
    port: int = 25
    tls: str = "starttls"  # smarthost: none, starttls or implicit; internet: opportunistic
    tls_ca_file: Path | None = None
    auth_user: str | None = None
    auth_secret_file: Path | None = None
    nameservers: tuple[tuple[str, int], ...] = ()  # internet: () the system's
    connect_timeout: float = 30.0
    destination_concurrency: int = 20  # connections per destination at once (Postfix's)
    dsn_stage: str | None = None
    delay_dsn_after: float = 4 * 3600.0
    hostname: str | None = None  # EHLO and Reporting-MTA; None: the machine's name

    @property
    def routes(self) -> tuple[tuple[str, str], ...]:
        return ()

    @property
    def spawns(self) -> tuple[tuple[str, str], ...]:
        return (("DSN_STAGE", self.dsn_stage),) if self.dsn_stage else ()

    @property
    def helo(self) -> str:
        return self.hostname or machine_name()

    def describe(self) -> str:
        if self.host is not None:
            return f"relay to {self.host}:{self.port} ({self.tls})"
        return "relay to the recipients' MX hosts" + (
            f" (port {self.port})" if self.port != 25 else ""
        )

    def check_at_start(self) -> None:
        from pepsi.mail.relay.slots import Slots  # noqa: PLC0415  # a relay's, for its workers

        self.secret()
        try:
            Slots(self.destination_concurrency)  # the slot folder: this user's alone
        except (OSError, RuntimeError) as exc:
            raise StartError("DESTINATION_CONCURRENCY", str(exc)) from None

    def secret(self) -> str | None:
        """AUTH_SECRET_FILE's password (read by the stage once per worker)."""
        if self.auth_secret_file is None:
            return None
        data = read_secret("AUTH_SECRET_FILE", self.auth_secret_file)
        try:
            return data.decode().strip()
        except UnicodeDecodeError:
            raise StartError(
                "AUTH_SECRET_FILE", f"{self.auth_secret_file} is not UTF-8 text"
            ) from None


@dataclass(frozen=True)
class DkimOptions:
    domain: str
    selector: str
    key_file: Path
    headers: tuple[str, ...] = DEFAULT_DKIM_HEADERS

    @property
    def routes(self) -> tuple[tuple[str, str], ...]:
        return ()

    def describe(self) -> str:
        return f"dkim-sign d={self.domain} s={self.selector}"

    def check_at_start(self) -> None:
        from pepsi.mail.protocol.dkim import load_key  # noqa: PLC0415  # cryptography, for its workers

        pem = read_secret("KEY_FILE", self.key_file)
        try:
            load_key(pem)
        except ValueError as exc:
            raise StartError("KEY_FILE", f"{self.key_file}: {exc}") from None


@dataclass(frozen=True)
class SrsOptions:
    domain: str
    secret_file: Path
    max_age: float = 21 * 86400.0  # how long a rewritten address is taken back

    @property
    def routes(self) -> tuple[tuple[str, str], ...]:
        return ()

    def describe(self) -> str:
        return f"srs @{self.domain}"

    def check_at_start(self) -> None:
        read_secret("SECRET_FILE", self.secret_file)

    def secret(self) -> bytes:
        return read_secret("SECRET_FILE", self.secret_file).strip()


@functools.cache
def machine_name() -> str:
    """The machine's name, asked once (socket.getfqdn may ask DNS each time)."""
    return socket.getfqdn()


def tls_mode(text: str) -> str:
    value = text.strip().lower()
    if value not in TLS_MODES:
        raise ValueError(f"expected one of {', '.join(TLS_MODES)}, got {text!r}")
    return value


def nameservers(text: str) -> tuple[tuple[str, int], ...]:
    """Name servers by IP address: ADDRESS or ADDRESS:PORT ([v6] or [v6]:PORT), separated
    by commas or spaces (the resolver asks addresses, not names)."""
    found = []
    for word in text.replace(",", " ").split():
        host, port = word, "53"
        if word.startswith("["):
            host, _, port = word[1:].partition("]")
            port = port.removeprefix(":") if port else "53"
        elif word.count(":") == 1:
            host, _, port = word.partition(":")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"expected name servers by IP address, such as 127.0.0.1:5353; got {word!r}"
            ) from None
        if not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"expected a port from 1 to 65535 in {word!r}")
        found.append((host, int(port)))
    if not found:
        raise ValueError("must name at least one server")
    return tuple(found)


def label(text: str) -> str:
    value = text.strip()
    if not _LABEL.fullmatch(value):
        raise ValueError(f"expected a DNS label such as mail2026, got {text!r}")
    return value


def domain(text: str) -> str:
    names = v.domain_names(text)
    if len(names) != 1 or names[0].startswith("."):
        raise ValueError(f"expected one domain name, got {text!r}")
    return names[0]


def header_names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip().lower() for n in text.replace(",", " ").replace(":", " ").split())
    bad = [n for n in names if not _HEADER_NAME.fullmatch(n)]
    if bad or not names:
        raise ValueError(f"expected header field names such as From, Subject; got {text!r}")
    if "from" not in names:
        raise ValueError("must include From (RFC 6376 §5.4: From is always signed)")
    return names


RELAY_KEYS: Mapping[str, tuple[str, Any]] = {
    "PORT": ("port", v.integer(1, 65535)),
    "CONNECT_TIMEOUT": ("connect_timeout", v.duration(0.1)),
    "DESTINATION_CONCURRENCY": ("destination_concurrency", v.integer(1, 1000)),
    "DSN_STAGE": ("dsn_stage", stage_ref),
    "DELAY_DSN_AFTER": ("delay_dsn_after", v.duration(1.0)),
    "HOSTNAME": ("hostname", v.host_name),
}
SMARTHOST_KEYS: Mapping[str, tuple[str, Any]] = {
    **RELAY_KEYS,
    "HOST": ("host", v.host_name),
    "TLS": ("tls", tls_mode),
    "TLS_CA_FILE": ("tls_ca_file", v.path),
    "AUTH_USER": ("auth_user", v.text),
    "AUTH_SECRET_FILE": ("auth_secret_file", v.path),
}
INTERNET_KEYS: Mapping[str, tuple[str, Any]] = {
    **RELAY_KEYS,
    "NAMESERVERS": ("nameservers", nameservers),
}
DKIM_KEYS: Mapping[str, tuple[str, Any]] = {
    "DOMAIN": ("domain", domain),
    "SELECTOR": ("selector", label),
    "KEY_FILE": ("key_file", v.path),
    "HEADERS": ("headers", header_names),
}
SRS_KEYS: Mapping[str, tuple[str, Any]] = {
    "DOMAIN": ("domain", domain),
    "SECRET_FILE": ("secret_file", v.path),
    "MAX_AGE": ("max_age", v.duration(86400.0)),
}
BOUNCE_MAIL_KEYS: Mapping[str, tuple[str, Any]] = {
    "DSN_STAGE": ("dsn_stage", stage_ref),
    "HOSTNAME": ("hostname", v.host_name),
}
