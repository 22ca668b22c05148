"""Publishing: a message becomes a committed row (the confirm, R-1).

    from pepsi import Publisher

    with Publisher.connect("pepsi.conf") as pub:
        wid = pub.publish("inbound", b"body", sender="a@example.org", recipients=["b@x.org"])
        pub.publish("orders", json={"order": 7})  # body as JSON, application/json

Sync and async share everything but the executor: `batch.py` turns messages
into one call of the SQL function `pepsi.workqueue_publish` (insert, dedup,
length limits, one NOTIFY) and reads its answer; `sync_client.py` and
`async_client.py` run it, on what `client_core.py` gives both; `pipeline.py`
streams batches with a bound on unconfirmed messages.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pepsi.publishing.errors import (
    InvalidMessage,
    NoRoute,
    NotConfirmed,
    NotOpen,
    PublishFailed,
    Rejected,
)
from pepsi.publishing.message import OutgoingMessage
from pepsi.publishing.retry import Retry

if TYPE_CHECKING:
    from pepsi.publishing.async_client import AsyncPublisher
    from pepsi.publishing.pipeline import Pipeline, SyncPipeline
    from pepsi.publishing.sync_client import Publisher

# each lazy name and the module it lives in
_CLIENT = {
    "AsyncPublisher": "pepsi.publishing.async_client",
    "Pipeline": "pepsi.publishing.pipeline",
    "Publisher": "pepsi.publishing.sync_client",
    "SyncPipeline": "pepsi.publishing.pipeline",
}


def __getattr__(name: str) -> Any:
    # The clients load psycopg_pool; commands that never publish skip it.
    if name in _CLIENT:
        return getattr(importlib.import_module(_CLIENT[name]), name)
    raise AttributeError(f"module 'pepsi.publishing' has no attribute {name!r}")


__all__ = [
    "AsyncPublisher",
    "InvalidMessage",
    "NoRoute",
    "NotConfirmed",
    "NotOpen",
    "OutgoingMessage",
    "Pipeline",
    "PublishFailed",
    "Publisher",
    "Rejected",
    "Retry",
    "SyncPipeline",
]
