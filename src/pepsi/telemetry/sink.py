"""What a worker and a publisher report to: `Sink`, off (`NO_SINK`) or on (`otel.OtelSink`).

The names both sides share, kept apart from `pepsi.telemetry` (which installs a sink and
imports `otel` only when on) so that `otel` does not import the package back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pepsi.publishing.message import OutgoingMessage

TRACEPARENT = "traceparent"  # W3C trace context, in a message's properties
SCOPE = "pepsi"
Outcome = Callable[[str], None]  # records a pass's outcome on its span


class Sink:
    """Telemetry off: nothing is reported, nothing is imported (`otel.OtelSink`: on)."""

    enabled = False

    @contextlib.contextmanager
    def stage_pass(self, msg_id: int, stage: str, parent: object) -> Iterator[Outcome]:
        yield _ignore

    @contextlib.contextmanager
    def publish(self, items: list[OutgoingMessage]) -> Iterator[list[OutgoingMessage]]:
        yield items

    def shutdown(self) -> None:
        return None


def _ignore(outcome: str) -> None:
    return None


NO_SINK = Sink()
