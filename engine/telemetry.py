"""OpenTelemetry spans of the search stages, and the current trace id for the message trace store.

Only the OpenTelemetry API is used here: until a process installs an SDK tracer provider
(:func:`serving.telemetry.install`) every call is a cheap no-op, so in-process evaluation and
training pay nothing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry import context, trace
from opentelemetry.trace import Status, StatusCode

TRACER = "hybrid_search"

DOOR = context.create_key("hybrid_search.door")  # set by the door a request came in by

tracer = trace.get_tracer(TRACER)
_query_text = [False]  # whether search spans carry the query itself (serving.telemetry.install says)


def export_query_text(on: bool) -> None:
    """Search spans carry the query's text (masked on export) when ``on``, else only its length."""
    _query_text[0] = on


@contextmanager
def search_span(door: str, query: str, top_k: int, filtered: bool) -> Iterator[trace.Span]:
    """The ``search`` span of one search, current while it runs, with the door it came by (its
    stage spans carry that too): ``door``, ``search.top_k``, ``search.query_chars`` (the query with
    :func:`export_query_text`), ``search.filtered``; ``error.type`` when it fails."""
    attributes = {"door": door, "search.top_k": top_k, "search.query_chars": len(query), "search.filtered": filtered}
    if _query_text[0]:
        attributes["search.query"] = query
    with tracer.start_as_current_span("search", attributes=attributes) as span:
        token = context.attach(context.set_value(DOOR, door))
        try:
            yield span
        except Exception as exc:
            span.set_attribute("error.type", type(exc).__name__)
            raise
        finally:
            context.detach(token)


def record_stages(
    spans: Mapping[str, Sequence[int]], top_k: int, found: Mapping[str, tuple[int | None, int | None]]
) -> None:
    """One child span of the current span per stage in ``spans`` (the query's stopwatch: each stage's
    start and time, perf_counter nanoseconds), made after the fact in one call. ``found``: per stage,
    (candidates asked for, candidates returned); a rerank stage that returned None failed (the fused
    order served). Nothing when no span records."""
    if not trace.get_current_span().is_recording():
        return
    door = context.get_value(DOOR)
    epoch = time.time_ns() - time.perf_counter_ns()
    for stage, (start, spent) in spans.items():
        at = epoch + start
        end = at + spent
        depth, count = found.get(stage, (None, None))
        attributes = {"search.stage": stage, "search.top_k": top_k}
        if door is not None:
            attributes["door"] = door
        if depth is not None:
            attributes["search.depth"] = depth
        if count is not None:
            attributes["search.candidates"] = count
        span = tracer.start_span(stage, start_time=at, attributes=attributes)
        if stage == "rerank" and count is None:
            span.set_attribute("error.type", "reranker_failed")
            span.set_status(Status(StatusCode.ERROR, "the reranker failed; the fused order served"))
        span.end(end_time=end)


def current_trace_id() -> str | None:
    """The OpenTelemetry trace id (32 hex digits) of the current span, None outside any trace."""
    context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else None
