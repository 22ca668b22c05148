"""Pepsi: a durable message pipeline for Python, stored in PostgreSQL."""

from __future__ import annotations

from typing import Any

from pepsi.errors import ConfigError, PepsiError
from pepsi.stage import (
    Advance,
    Finish,
    Message,
    Needs,
    Outcome,
    Pause,
    PermanentError,
    stage,
)

__version__ = "0.1.0"

# The publishing names load psycopg_pool: imported on first use, so that a
# worker process (which imports this package) starts faster.
_PUBLISHING = {
    "AsyncPublisher",
    "InvalidMessage",
    "NoRoute",
    "NotConfirmed",
    "OutgoingMessage",
    "Publisher",
    "Rejected",
}


def __getattr__(name: str) -> Any:
    if name in _PUBLISHING:
        from pepsi import publishing  # noqa: PLC0415

        return getattr(publishing, name)
    raise AttributeError(f"module 'pepsi' has no attribute {name!r}")


__all__ = [
    "Advance",
    "AsyncPublisher",
    "ConfigError",
    "Finish",
    "InvalidMessage",
    "Message",
    "Needs",
    "NoRoute",
    "NotConfirmed",
    "Outcome",
    "OutgoingMessage",
    "Pause",
    "PepsiError",
    "PermanentError",
    "Publisher",
    "Rejected",
    "__version__",
    "stage",
]
