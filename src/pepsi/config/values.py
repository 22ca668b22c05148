"""Value parsers: each returns the typed value or raises ValueError(problem).

The problem text becomes the end of a ConfigError that names the file,
section and key, so it says what was expected and what was found.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path

from pepsi.config.model import MIB, Overflow
from pepsi.durations import parse_duration

STAGE_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
HANDLER_REF = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")

_SIZE = re.compile(r"(\d+)\s*([kmg]i?b?|b)?", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def boolean(text: str) -> bool:
    word = text.strip().lower()
    if word in ("yes", "true", "on", "1"):
        return True
    if word in ("no", "false", "off", "0"):
        return False
    raise ValueError(f"expected yes or no, got {text!r}")


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise ValueError(f"must be {bound}, got {value}")
        return value

    return parse


def duration(minimum: float = 0.001) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = parse_duration(text)
        if value < minimum:
            raise ValueError(f"must be at least {minimum:g}s, got {text!r}")
        return value

    return parse


def size(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        match = _SIZE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"expected a size such as 512K or 64M, got {text!r}")
        unit = (match.group(2) or "").lower()[:1]
        value = int(match.group(1)) * _SIZE_UNITS[unit]
        if not low <= value <= high:
            raise ValueError(f"must be between {low} bytes and {high // MIB}M, got {text!r}")
        return value

    return parse


def text(value: str) -> str:
    stripped = value.strip()
    if not stripped:
        raise ValueError("must not be empty")
    return stripped


def listen_address(text: str) -> tuple[str, int] | None:
    """HOST:PORT (an IPv6 host in brackets), or `off`; port 0 picks a free one."""
    value = text.strip()
    if value.lower() in ("", "off", "no"):
        return None
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:9464, or off; got {text!r}")
    return host, int(port)


def host_port(host: str, port: int) -> str:
    """HOST:PORT as `listen_address` reads it back (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def public_url(text: str) -> str:
    """The console's address as its browsers see it (behind a proxy): http(s)://HOST[:PORT],
    no path; ValueError for anything else."""
    value = text.strip().rstrip("/")
    match = re.fullmatch(r"(https?)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::(\d{1,5}))?", value)
    if match is None:
        raise ValueError(f"expected http(s)://HOST[:PORT] (no path), got {text.strip()!r}")
    return value.lower()


def password_hash(text: str) -> str:
    """A stored password: the scrypt string `pepsi web password` prints, never a password."""
    value = text.strip()
    if not value.startswith("$scrypt$") or value.count("$") != 4:
        raise ValueError(
            "expected the hash `pepsi web password` prints ($scrypt$...), not a password"
        )
    return value


def path(value: str) -> Path:
    return Path(text(value)).expanduser()


AMQP_STAGE_PREFIX = "amqp:"


def amqp_stage(vhost: str, queue: str) -> str:
    """The stage of AMQP queue `queue` in `vhost` (as pepsi.amqp_queue_stage names it)."""
    encoded = vhost.replace("%", "%25").replace(":", "%3A")
    return f"{AMQP_STAGE_PREFIX}{encoded}:{queue}"


def is_amqp_stage(name: str) -> bool:
    return name.startswith(AMQP_STAGE_PREFIX)


def stage_ref(text: str) -> str:
    """A stage of the file, or an AMQP queue: `amqp:QUEUE` (vhost /) or `amqp:VHOST:QUEUE`."""
    value = text.strip()
    if is_amqp_stage(value):
        rest = value[len(AMQP_STAGE_PREFIX) :]
        vhost, _, queue = rest.partition(":") if ":" in rest else ("/", "", rest)
        if not vhost or not queue or len(queue.encode()) > 255 or len(vhost.encode()) > 255:
            raise ValueError(f"expected amqp:QUEUE or amqp:VHOST:QUEUE, got {text!r}")
        return amqp_stage(vhost, queue)
    if not STAGE_NAME.fullmatch(value):
        raise ValueError(f"not a stage name: {text!r}")
    return value


def stage_names(text: str) -> tuple[str, ...]:
    """A comma-separated list of stages of the file."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    for name in names:
        if not STAGE_NAME.fullmatch(name):
            raise ValueError(f"not a stage name: {name!r}")
    return names


def program(value: str) -> str:
    command = text(value)
    if "/" in command and not command.startswith("/"):
        raise ValueError(f"must be a command on PATH or an absolute path, got {command!r}")
    return command


def handler(text: str) -> str:
    value = text.strip()
    if not HANDLER_REF.fullmatch(value):
        raise ValueError(f"expected package.module:function, got {text!r}")
    return value


def overflow(text: str) -> Overflow:
    try:
        return Overflow(text.strip().lower())
    except ValueError:
        choices = ", ".join(o.value for o in Overflow)
        raise ValueError(f"expected one of {choices}, got {text!r}") from None


def sink(text: str) -> str | None:
    """A stage name, or `table` for pepsi.dead_letter."""
    value = text.strip()
    if value.lower() == "table":
        return None
    return stage_ref(value)


def listen_addresses(text: str) -> tuple[tuple[str, int], ...]:
    """A list of HOST:PORT separated by commas or spaces; `off` or empty: none."""
    words = text.replace(",", " ").split()
    if [w.lower() for w in words] in ([], ["off"], ["no"]):
        return ()
    found = []
    for word in words:
        address = listen_address(word)
        if address is None:
            raise ValueError(f"expected HOST:PORT, got {word!r} in {text!r}")
        found.append(address)
    return tuple(found)


def address_or_socket(text: str) -> tuple[str, int] | Path | None:
    """HOST:PORT, an absolute path (a UNIX socket), or `off`."""
    value = text.strip()
    if value.startswith("/"):
        return Path(value)
    try:
        return listen_address(value)
    except ValueError:
        raise ValueError(
            f"expected HOST:PORT, the absolute path of a UNIX socket, or off; got {text!r}"
        ) from None


# A domain name: labels of letters (any script), digits and hyphens, dot-separated.
_DOMAIN = re.compile(r"(?:[^\W_](?:[\w-]{0,61}[^\W_])?\.)*[^\W_](?:[\w-]{0,61}[^\W_])?")


def domain_names(text: str) -> tuple[str, ...]:
    """Domains separated by commas or spaces, lower-cased; `.example.com` means its subdomains."""
    found: list[str] = []
    for word in text.replace(",", " ").split():
        name = word.lower().rstrip(".")
        bare = name[1:] if name.startswith(".") else name
        if not _DOMAIN.fullmatch(bare) or len(bare) > 253:
            raise ValueError(f"not a domain name: {word!r}")
        if name not in found:
            found.append(name)
    return tuple(found)


def networks(text: str) -> tuple[IPv4Network | IPv6Network, ...]:
    """IP networks (`10.0.0.0/8`, `2001:db8::/32`, or one address) separated by commas or spaces."""
    found = []
    for word in text.replace(",", " ").split():
        try:
            found.append(ip_network(word, strict=False))
        except ValueError:
            raise ValueError(f"not an IP network such as 192.0.2.0/24: {word!r}") from None
    return tuple(found)


def host_name(text: str) -> str:
    """A host name for the SMTP banner and Received: (letters, digits, '-' and '.')."""
    value = text.strip().rstrip(".")
    if not re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?", value):
        raise ValueError(f"not a host name: {text!r}")
    return value


def is_loopback(host: str | None) -> bool:
    """127.0.0.0/8, ::1, or an IPv4 loopback address mapped into IPv6."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host == "localhost"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
