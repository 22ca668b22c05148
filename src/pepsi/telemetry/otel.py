"""The OpenTelemetry side of `pepsi.telemetry`, imported only when telemetry is on (P-11).

Kept apart so that a worker or a publisher with telemetry off never loads
OpenTelemetry (`python -X importtime pepsi worker` shows none of it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context as OtelContext
from opentelemetry.metrics import Meter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pepsi.config import Config, StageConfig
from pepsi.telemetry.features import features
from pepsi.telemetry.sink import SCOPE, TRACEPARENT, Outcome, Sink

if TYPE_CHECKING:
    from pepsi.publishing.message import OutgoingMessage

log = logging.getLogger("pepsi.telemetry")


class OtelSink(Sink):
    """Telemetry on: spans to `provider`'s exporters, counters to its meter provider."""

    enabled = True

    def __init__(self, provider: TracerProvider, meter_provider: MeterProvider | None) -> None:
        self.provider = provider
        self.meter_provider = meter_provider
        self.tracer = provider.get_tracer(SCOPE)
        self.propagator = TraceContextTextMapPropagator()

    def _parent(self, traceparent: object) -> OtelContext | None:
        if not isinstance(traceparent, str):
            return None  # no publish span (telemetry was off there), or not one of ours
        return self.propagator.extract({TRACEPARENT: traceparent})

    @contextlib.contextmanager
    def stage_pass(self, msg_id: int, stage: str, parent: object) -> Iterator[Outcome]:
        """One span around one message's pass through `stage`, a child of its publish span."""
        attributes = {
            "messaging.system": SCOPE,
            "messaging.message.id": str(msg_id),
            "pepsi.stage": stage,
        }
        # Current, so that spans the stage function makes are children of the pass.
        with self.tracer.start_as_current_span(
            f"pepsi stage {stage}",
            context=self._parent(parent),
            kind=SpanKind.CONSUMER,
            attributes=attributes,
        ) as span:
            yield lambda outcome: span.set_attribute("pepsi.outcome", outcome)

    @contextlib.contextmanager
    def publish(self, items: list[OutgoingMessage]) -> Iterator[list[OutgoingMessage]]:
        """One span for a publish call; its context added to each message's properties."""
        with self.tracer.start_as_current_span(
            "pepsi publish",
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": SCOPE,
                "messaging.batch.message_count": len(items),
                "pepsi.stages": sorted({m.stage for m in items}),
            },
        ) as span:
            carrier: dict[str, str] = {}
            self.propagator.inject(carrier, context=set_span_in_context(span))
            parent = carrier.get(TRACEPARENT)
            yield items if parent is None else [_with_parent(m, parent) for m in items]

    def shutdown(self) -> None:
        self.provider.shutdown()  # exports what the batch processor still holds
        if self.meter_provider is not None:
            self.meter_provider.shutdown()


def _with_parent(msg: OutgoingMessage, traceparent: str) -> OutgoingMessage:
    if not isinstance(msg.properties, dict):
        return msg  # not a mapping: the publish refuses it, as without telemetry
    return dataclasses.replace(msg, properties={**msg.properties, TRACEPARENT: traceparent})


def build(
    config: Config,
    stage: StageConfig | None,
    span_exporter: SpanExporter | None = None,
    metric_reader: MetricReader | None = None,
) -> OtelSink:
    """A sink on exporters from the OTEL_* variables, or on the ones given (tests).

    From the variables, the provider also becomes OpenTelemetry's global one,
    so that a stage's own spans join its pass's trace; if the application
    already set a global one, Pepsi's spans go to it instead. Given exporters
    leave the global provider alone.
    """
    resource = Resource.create()  # reads OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": SCOPE}))
    readers: list[MetricReader] = [] if metric_reader is None else [metric_reader]
    current = trace.get_tracer_provider()
    if span_exporter is not None:
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    else:
        readers += [PeriodicExportingMetricReader(e) for e in exporters("metrics")]
        if isinstance(current, TracerProvider):
            provider = current  # the application's (or a stage module's, imported first)
        else:
            provider = TracerProvider(resource=resource)
            for exporter in exporters("traces"):
                provider.add_span_processor(BatchSpanProcessor(exporter))
            trace.set_tracer_provider(provider)
    meter_provider = MeterProvider(resource=resource, metric_readers=readers) if readers else None
    if stage is not None and meter_provider is not None:
        count_features(meter_provider.get_meter(SCOPE), config, stage)
    return OtelSink(provider, meter_provider)


def exporters(signal: str) -> list[Any]:
    """The exporters `OTEL_<SIGNAL>_EXPORTER` names, found as OpenTelemetry's distro finds them.

    The default is `otlp` (gRPC; HTTP with `OTEL_EXPORTER_OTLP_PROTOCOL=
    http/protobuf`), `none` is none, and any other name is an entry point of
    group `opentelemetry_<signal>_exporter` that an installed package declares
    (`console` is the SDK's, here on stderr). Each exporter reads its own variables
    (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_HEADERS` …).
    """
    upper = signal.upper()
    names = os.environ.get(f"OTEL_{upper}_EXPORTER", "otlp")
    protocol = os.environ.get(
        f"OTEL_EXPORTER_OTLP_{upper}_PROTOCOL",
        os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
    )
    found = {e.name: e for e in entry_points(group=f"opentelemetry_{signal}_exporter")}
    chosen = []
    for raw in names.split(","):
        name = raw.strip().lower()
        if name in ("", "none"):
            continue
        if name == "otlp":
            name = "otlp_proto_http" if protocol == "http/protobuf" else "otlp_proto_grpc"
        if name not in found:
            log.warning("OTEL_%s_EXPORTER: no exporter named %s installed: ignored", upper, name)
            continue
        if name == "console":  # stdout is a worker's status channel: never there
            chosen.append(found[name].load()(out=sys.stderr))
            continue
        chosen.append(found[name].load()())
    return chosen


def count_features(meter: Meter, config: Config, stage: StageConfig) -> None:
    """Once per worker start: its stage's kind and option names, as counters."""
    kind, options = features(config, stage)
    starts = meter.create_counter("pepsi.worker.starts", description="workers started, by kind")
    starts.add(1, kind)
    used = meter.create_counter("pepsi.stage.options", description="options set, by name")
    for name in options:
        used.add(1, {**kind, "pepsi.option": name})
