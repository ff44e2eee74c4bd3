"""OpenTelemetry for the doors: W3C ``traceparent`` in and out, a server span per HTTP request, a
``search`` span per search (the engine's, :func:`engine.telemetry.search_span`), and (with
``--otlp-endpoint``) masked export over OTLP/HTTP.

:func:`install` puts the SDK's tracer provider in place once per process, with or without export,
so that every request has a real trace id: the one its response's ``traceparent`` header names
and the message trace store keeps beside the protocol's own trace ids. Export runs on the SDK's
batch thread (a bounded queue, a short timeout): a request only appends its finished spans to a
queue and never waits for, or fails because of, a collector that is slow or down; when the
queue is full new spans are dropped (and said so in the log, at most once a minute).

Exported spans pass through the trace store's :class:`~agents.traces.Masker` first (names,
attributes, event attributes such as exception messages, status descriptions): what the trace
store masks never reaches a collector either. Query texts are not exported unless
``--otlp-query-text`` says so (then masked); the search span carries their length.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from opentelemetry import context, trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.types import ASGIApp, Receive, Scope, Send

from agents.traces import Masker
from engine import telemetry as engine_telemetry
from engine.telemetry import DOOR, tracer
from serving.asgi import route_path
from serving.settings import Settings

log = logging.getLogger(__name__)
EXPORT_TIMEOUT_S = 3.0  # one export (retries included); OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT overrides
SHUTDOWN_S = 5.0  # what a stopping server spends sending the spans still queued
W3C = TraceContextTextMapPropagator()
# kept as they are, as the trace store keeps them in its columns (the masks would take the digits
# of ret-20261124-000001 or of the MCP version 2025-11-25 for a phone number)
UNMASKED = frozenset(
    {"protocol.trace_id", "protocol.message.type", "protocol.sender", "protocol.receiver", "mcp.protocol.version"}
)
_provider: list[TracerProvider] = []  # the one this process installed
_install_lock = threading.Lock()


def install(settings: Settings) -> None:
    """The SDK tracer provider, once per process, exporting to ``settings.telemetry.otlp_endpoint`` when set.
    ``OTEL_SDK_DISABLED=true`` leaves tracing off: no spans, no ids (the benchmark's baseline)."""
    engine_telemetry.export_query_text(settings.telemetry.otlp_query_text)
    with _install_lock:
        if _provider or os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return
        service = os.environ.get("OTEL_SERVICE_NAME") or "hybrid-search"
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        if settings.telemetry.otlp_endpoint:
            provider.add_span_processor(
                BatchSpanProcessor(MaskingExporter(_otlp(settings.telemetry.otlp_endpoint), Masker()))
            )
            log.info("exporting spans to %s", traces_url(settings.telemetry.otlp_endpoint))
        trace.set_tracer_provider(provider)
        _provider.append(provider)


def _otlp(endpoint: str) -> SpanExporter:
    """OTLP/HTTP protobuf to ``endpoint``, each export (retries included) given up after
    EXPORT_TIMEOUT_S; the batch processor's queue (2048 spans) and pace (every 5 s) are the SDK's,
    set by ``OTEL_BSP_*``. Its failures and dropped spans are logged once a minute, not per batch."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    env_timeout = any(os.environ.get(f"OTEL_EXPORTER_OTLP{k}_TIMEOUT") for k in ("", "_TRACES"))
    for name in ("opentelemetry.sdk._shared_internal", OTLPSpanExporter.__module__):
        logging.getLogger(name).addFilter(OncePerMinute())  # a logger's filters see its own records only
    return OTLPSpanExporter(traces_url(endpoint), timeout=None if env_timeout else EXPORT_TIMEOUT_S)


def shutdown(timeout_s: float = SHUTDOWN_S) -> None:
    """Send what is queued, for at most ``timeout_s`` (a collector that is down cannot hold a
    stopping server up: the SDK's own shutdown may wait 30 s for its batch thread)."""
    for provider in _provider:
        stopping = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
        stopping.start()
        stopping.join(timeout_s)


def traces_url(endpoint: str) -> str:
    """``http://host:4318`` -> ``http://host:4318/v1/traces``; a URL with a path is kept as given."""
    return endpoint.rstrip("/") + "/v1/traces" if urlsplit(endpoint).path in ("", "/") else endpoint


class OncePerMinute(logging.Filter):
    """Lets a logger's records through at most once a minute per message (a collector that is down
    would otherwise log every dropped span and every failed batch)."""

    def __init__(self, every_s: float = 60.0) -> None:
        super().__init__()
        self.every_s, self.last = every_s, {}

    def filter(self, record: logging.LogRecord) -> bool:
        now, key = time.monotonic(), record.msg
        if now - self.last.get(key, -self.every_s) < self.every_s:
            return False
        self.last[key] = now
        return True


class MaskingExporter(SpanExporter):
    """Masks every span on the way out (on the batch thread, never a request's)."""

    def __init__(self, inner: SpanExporter, mask: Masker) -> None:
        self.inner, self.mask = inner, mask

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return self.inner.export([self._masked(span) for span in spans])

    def _attributes(self, attributes) -> dict:
        return {k: v if k in UNMASKED else self._value(v) for k, v in (attributes or {}).items()}

    def _value(self, value):
        return tuple(self.mask(list(value))) if isinstance(value, tuple) else self.mask(value)

    def _masked(self, span: ReadableSpan) -> ReadableSpan:
        status = span.status
        if status.description:
            status = Status(status.status_code, self.mask(status.description))
        return ReadableSpan(
            name=self.mask(span.name),
            context=span.context,
            parent=span.parent,
            resource=span.resource,
            attributes=self._attributes(span.attributes),
            events=[Event(e.name, self._attributes(e.attributes), e.timestamp) for e in span.events],
            links=span.links,
            kind=span.kind,
            status=status,
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.instrumentation_scope,
        )

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _Headers(DefaultGetter):
    """Reads the propagator's headers from an ASGI scope's raw header list."""

    def get(self, carrier: dict, key: str):
        value = carrier.get(key.encode("latin-1"))
        return [value.decode("latin-1")] if value is not None else None

    def keys(self, carrier: dict) -> list[str]:
        return [k.decode("latin-1") for k in carrier]


def door_of(app_door: str, path: str) -> str:
    """Which door a request came in by: ``mcp``, ``rest``, ``protocol`` (/v1, /ui) or ``a2a``."""
    if app_door != "mcp":
        return app_door
    if path == "/mcp" or path.startswith("/mcp/"):
        return "mcp"
    return "protocol" if path.startswith("/v1/") or path == "/ui" else "rest"


class TracedDoor:
    """A server span per HTTP request, continuing the caller's W3C ``traceparent`` (a new trace
    without one), named ``METHOD route``, with ``http.request.method``, ``url.path``, ``http.route``,
    ``http.response.status_code`` and ``door``; the response carries the span's ``traceparent``."""

    def __init__(self, app: ASGIApp, door: str) -> None:
        self.app, self.door = app, door

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        parent = W3C.extract(dict(scope.get("headers") or []), getter=_Headers())
        method, path = scope["method"], route_path(scope)
        door = door_of(self.door, path)
        attributes = {"http.request.method": method, "url.path": path, "door": door}
        with tracer.start_as_current_span(method, parent, SpanKind.SERVER, attributes) as span:
            token = context.attach(context.set_value(DOOR, door))
            span_context = span.get_span_context()

            async def send_traced(message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        span.set_attribute("error.type", str(status))
                        span.set_status(Status(StatusCode.ERROR))
                    if span_context.is_valid:
                        carrier: dict[str, str] = {}
                        W3C.inject(carrier, trace.set_span_in_context(span))
                        message.setdefault("headers", []).append((b"traceparent", carrier["traceparent"].encode()))
                await send(message)

            try:
                await self.app(scope, receive, send_traced)
            finally:
                context.detach(token)
                route = getattr(scope.get("route"), "path", None)
                if route:
                    span.set_attribute("http.route", route)
                    span.update_name(f"{method} {route}")
