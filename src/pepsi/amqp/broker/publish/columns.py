"""A publish's values as its rows' columns: text SQL can store, the peer, the routing JSON.

Pure. The raw property octets are stored whole either way; a column is for SQL.
"""

from __future__ import annotations

import ipaddress
import json

from pepsi.addresses import MAX_TEXT  # a longer property is not copied into its column


def column_text(value: object) -> str | None:
    """A property as a text column: a str PostgreSQL can store, not too long; else None.

    The property stays in the raw header either way; the column is for SQL.
    """
    if value is None:  # the common case, three times per publish
        return None
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or "\x00" in value or len(value) > MAX_TEXT:
        return None
    return value


def column_peer(peer: str | None) -> str | None:
    if peer is None:
        return None
    try:
        return str(ipaddress.ip_address(peer))
    except ValueError:
        return None


def routing_json(exchange: str, routing_key: str) -> str:
    """What a consumer needs back for basic.deliver, in `workqueue.properties`."""
    return json.dumps({"exchange": exchange, "routing_key": routing_key}).replace("\\u0000", "")
