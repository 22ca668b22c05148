"""Test only: an OpenTelemetry span exporter that appends JSON lines to $PEPSI_TEST_SPANS.

On PYTHONPATH with its dist-info next to it, it is an installed exporter
like any other: `OTEL_TRACES_EXPORTER=pepsi_test_file` selects it in a
worker process, through the same entry-point lookup as `otlp` or `console`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


class FileSpanExporter(SpanExporter):
    def __init__(self) -> None:
        self.path = Path(os.environ["PEPSI_TEST_SPANS"])

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            attributes = dict(span.attributes or {})
            assert span.context is not None
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "trace_id": span.context.trace_id,
                        "parent_id": None if span.parent is None else span.parent.span_id,
                        "message_id": attributes.get("messaging.message.id"),
                        "stage": attributes.get("pepsi.stage"),
                        "outcome": attributes.get("pepsi.outcome"),
                        "pid": os.getpid(),
                    }
                )
                + "\n"
            )
        # One write per batch in append mode: lines of concurrent workers do not interleave.
        with self.path.open("a", encoding="utf-8") as out:
            out.write("".join(lines))
        return SpanExportResult.SUCCESS
