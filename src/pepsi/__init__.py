"""Pepsi: a durable message pipeline for Python, stored in PostgreSQL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pepsi.config import Config, load_config
from pepsi.errors import (
    ConfigError,
    DatabaseBusy,
    DatabaseLost,
    DatabaseReadOnly,
    DatabaseUnavailable,
    InvalidMessage,
    NoRoute,
    NotConfirmed,
    NotOpen,
    PepsiError,
    PublishFailed,
    Rejected,
    SchemaMismatch,
)
from pepsi.stage import (
    Advance,
    Defer,
    Fail,
    Finish,
    Message,
    Needs,
    NewMessage,
    Outcome,
    Part,
    Pause,
    PermanentError,
    Split,
    stage,
)

if TYPE_CHECKING:  # mypy sees the real types; at run time they load on first use
    from pepsi.publishing import (
        AsyncPublisher,
        OutgoingMessage,
        Pipeline,
        Publisher,
        Retry,
        SyncPipeline,
    )

__version__ = "0.1.0"

# The publishing clients load psycopg_pool: imported on first use, so that a
# worker process (which imports this package) starts faster. (Their errors
# live in pepsi.errors, imported above.)
_PUBLISHING = frozenset(
    {"AsyncPublisher", "OutgoingMessage", "Pipeline", "Publisher", "Retry", "SyncPipeline"}
)


def __getattr__(name: str) -> Any:
    if name in _PUBLISHING:
        from pepsi import publishing  # noqa: PLC0415

        return getattr(publishing, name)
    raise AttributeError(f"module 'pepsi' has no attribute {name!r}")


__all__ = [
    "Advance",
    "AsyncPublisher",
    "Config",
    "ConfigError",
    "DatabaseBusy",
    "DatabaseLost",
    "DatabaseReadOnly",
    "DatabaseUnavailable",
    "Defer",
    "Fail",
    "Finish",
    "InvalidMessage",
    "Message",
    "Needs",
    "NewMessage",
    "NoRoute",
    "NotConfirmed",
    "NotOpen",
    "Outcome",
    "OutgoingMessage",
    "Part",
    "Pause",
    "PepsiError",
    "PermanentError",
    "Pipeline",
    "PublishFailed",
    "Publisher",
    "Rejected",
    "Retry",
    "SchemaMismatch",
    "Split",
    "SyncPipeline",
    "__version__",
    "load_config",
    "stage",
]
