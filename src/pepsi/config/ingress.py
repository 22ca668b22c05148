"""`[pepsi-ingress]`: the publishers' limits and the SMTP/LMTP server's keys.

The keys are parsed one by one like every section's (`keys.parse_section`);
`ingress_options` then checks what only the whole section can tell: a
listener needs a STAGE that exists, TLS needs both its files, and a message
of MAX_SIZE must still fit MAX_MESSAGE_SIZE once its `Received:` is added.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from pepsi.config import values as v
from pepsi.config.model import MIB, IngressOptions, RawValue, origin_of
from pepsi.errors import ConfigError

SECTION = "pepsi-ingress"
# What the server adds to a message before it is stored: its Received: header.
RECEIVED_HEADROOM = 16 * 1024

INGRESS_KEYS: Mapping[str, tuple[str, Any]] = {
    "DEDUP_WINDOW": ("dedup_window", v.duration(1.0)),
    "MAX_MESSAGE_SIZE": ("max_message_size", v.size(1024, 512 * MIB)),
    "LISTEN": ("listen", v.listen_addresses),
    "LMTP_LISTEN": ("lmtp_listen", v.address_or_socket),
    "STAGE": ("stage", v.stage_ref),
    "DOMAINS": ("domains", v.domain_names),
    "RELAY_NETWORKS": ("relay_networks", v.networks),
    "MAX_SIZE": ("max_size", v.size(1024, 512 * MIB)),
    "MAX_RECIPIENTS": ("max_recipients", v.integer(1, 100_000)),
    "HOSTNAME": ("hostname", v.host_name),
    "TLS_CERT": ("tls_cert", v.path),
    "TLS_KEY": ("tls_key", v.path),
    "TIMEOUT": ("timeout", v.duration(1.0)),
    "MAX_CONNECTIONS": ("max_connections", v.integer(1, 1_000_000)),
    "CLIENT_CONNECTION_LIMIT": ("client_connection_limit", v.integer(0, 1_000_000)),
}


def ingress_options(
    values: dict[str, Any], keys: Mapping[str, RawValue], stages: Collection[str], file: str | None
) -> IngressOptions:
    """The section's options, or one ConfigError naming the key that is wrong."""

    def fail(key: str, problem: str) -> ConfigError:
        return ConfigError(problem, file=origin_of(keys, key, file), section=SECTION, key=key)

    options = IngressOptions(**values)
    serving = bool(options.listen) or options.lmtp_listen is not None
    if options.stage is not None and options.stage not in stages:
        raise fail("STAGE", f"no stage named {options.stage!r}")
    if serving and options.stage is None:
        listener = "LISTEN" if options.listen else "LMTP_LISTEN"
        raise fail(listener, "the mail server needs STAGE, the first stage of accepted mail")
    if (options.tls_cert is None) != (options.tls_key is None):
        missing = "TLS_KEY" if options.tls_key is None else "TLS_CERT"
        present = "TLS_CERT" if missing == "TLS_KEY" else "TLS_KEY"
        raise fail(present, f"set {missing} too (STARTTLS needs a certificate and its key)")
    if serving and options.max_size + RECEIVED_HEADROOM > options.max_message_size:
        raise fail(
            "MAX_SIZE",
            f"{options.max_size} bytes must leave {RECEIVED_HEADROOM // 1024}K under "
            f"MAX_MESSAGE_SIZE ({options.max_message_size} bytes) for the Received: header",
        )
    return options
