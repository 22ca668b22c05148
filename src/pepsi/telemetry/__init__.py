"""Feature telemetry (SPEC P-11): OpenTelemetry spans and counters, off by default.

`[pepsi] SHARE_TELEMETRY = yes` turns it on. A worker reads it once, at
start (`install`): turning it on or off later is `pepsi telemetry on|off`,
which rewrites the file and tells the dispatcher to replace every worker.

What is reported, when on: one span per stage pass (message id, stage,
outcome; the span's own start and end are the duration), a publish span
whose context travels in the message's `traceparent` property so that a
message's journey is one trace, and counters of the features a worker's
stage uses (its kind, the built-in's name, the NAMES of the options set).
Never message content, addresses, option values or handler names.

Where it goes is OpenTelemetry's business: the standard `OTEL_*` variables
(`OTEL_TRACES_EXPORTER`, default `otlp`; `OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_SERVICE_NAME` …). The packages are the optional extra
`pepsi[telemetry]`; without them telemetry stays off after one warning.

Off, nothing of OpenTelemetry is imported and the sink is `NO_SINK`, whose
`enabled` is False: the worker's loop tests that flag and nothing else.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pepsi.config import Config, StageConfig
from pepsi.telemetry.features import features
from pepsi.telemetry.sink import NO_SINK, SCOPE, TRACEPARENT, Outcome, Sink

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricReader
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("pepsi.telemetry")

_process_sink: Sink | None = None  # what this process's publishers report to


# -- installing --------------------------------------------------------------------------


def install(
    config: Config,
    stage: StageConfig | None = None,
    *,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> Sink:
    """The sink a worker (or a publisher) reports to, set up once from `config`.

    With `span_exporter`/`metric_reader` (tests), those and nothing else; the
    process-wide OpenTelemetry provider is then left alone.
    """
    global _process_sink  # noqa: PLW0603  # one sink per process, as OpenTelemetry has
    if not config.pepsi.share_telemetry:
        return NO_SINK
    try:
        from pepsi.telemetry import otel  # noqa: PLC0415  # only when on: off imports none of it

        sink: Sink = otel.build(config, stage, span_exporter, metric_reader)
    except ImportError as exc:
        log.warning(
            "SHARE_TELEMETRY is on but OpenTelemetry is missing (%s): telemetry off; "
            "install pepsi[telemetry]",
            exc.name or exc,
        )
        sink = NO_SINK
    except Exception as exc:  # noqa: BLE001  # telemetry never keeps a worker from running
        log.warning("telemetry could not be set up (%s): telemetry off", exc)
        sink = NO_SINK
    _process_sink = sink
    return sink


def for_publisher(config: Config) -> Sink:
    """This process's sink for a publisher of `config` (installed on first use)."""
    if not config.pepsi.share_telemetry:
        return NO_SINK
    return _process_sink if _process_sink is not None else install(config)


__all__ = [
    "NO_SINK", "SCOPE", "TRACEPARENT", "Outcome", "Sink", "features", "for_publisher", "install",
]  # fmt: skip
