"""OpenTelemetry spans of the search stages, and the current trace id for the message trace store.

Only the OpenTelemetry API is used here: until a process installs an SDK tracer provider
(:func:`serving.telemetry.install`) every call is a cheap no-op, so in-process evaluation and
training pay nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from opentelemetry import context, trace
from opentelemetry.trace import Status, StatusCode

TRACER = "hybrid_search"

DOOR = context.create_key("hybrid_search.door")  # set by the door a request came in by

tracer = trace.get_tracer(TRACER)


def record_stages(
    started: float, seconds: Mapping[str, float], top_k: int, found: Mapping[str, tuple[int | None, int | None]]
) -> None:
    """One child span of the current span per stage timed in ``seconds`` (the query's stopwatch laps,
    in the order they ran, laid end to end from ``started``, a perf_counter reading), made after the
    fact in one call. ``found``: per stage, (candidates asked for, candidates returned); a rerank
    stage that returned None failed (the fused order served). Nothing when no span records."""
    if not trace.get_current_span().is_recording():
        return
    door = context.get_value(DOOR)
    at = time.time_ns() - time.perf_counter_ns() + int(started * 1e9)
    for stage, spent in seconds.items():
        if stage == "total":
            continue
        end = at + int(spent * 1e9)
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
        at = end


def current_trace_id() -> str | None:
    """The OpenTelemetry trace id (32 hex digits) of the current span, None outside any trace."""
    context = trace.get_current_span().get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else None
