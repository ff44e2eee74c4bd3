"""The router: validate a message, hand it to its receiver, store both, answer with the reply.

Every failure is an ERROR_MESSAGE with a code from the protocol's table, never a stack trace. A
failure whose code says ``retry_possible`` is retried with bounded exponential backoff before it
is returned, a timeout excepted (:meth:`Router._deliver` says why). Each agent's counters
(messages, errors, mean time, last heartbeat) feed its health.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from opentelemetry.trace import Span, StatusCode
from pydantic import BaseModel, ValidationError

from agents.messages import ERRORS, PAYLOADS, ErrorCode, ErrorPayload, Message, OriginalRequest
from agents.traces import TraceStore
from engine.documents import problems
from engine.telemetry import tracer

log = logging.getLogger(__name__)
ROUTER_ID = "Router"


class AgentError(Exception):
    """What an agent raises to answer with an ERROR_MESSAGE of ``code``; ``retry_after_s``, when the
    failure knows when to come back, goes in the reply's metadata and the HTTP door's Retry-After."""

    def __init__(self, code: ErrorCode, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s


class Agent(Protocol):
    agent_id: str
    agent_type: str
    capabilities: list[str]
    message_types: set[str]

    async def handle(self, message: Message, payload: BaseModel) -> tuple[str, BaseModel]:
        """The reply's type and payload for a validated message."""
        ...


@dataclass
class AgentStats:
    processed: int = 0
    errors: int = 0
    total_ms: float = 0.0
    last_heartbeat: datetime = field(default_factory=lambda: datetime.now(UTC))

    def health(self, agent: Agent) -> dict[str, Any]:
        return {
            "agent_id": agent.agent_id,
            "agent_type": agent.agent_type,
            "status": "healthy" if self.error_rate < 0.5 or self.processed < 4 else "degraded",
            "last_heartbeat": self.last_heartbeat.isoformat(),
            "messages_processed": self.processed,
            "average_response_time_ms": round(self.total_ms / self.processed, 2) if self.processed else 0.0,
            "error_rate": round(self.error_rate, 4),
            "capabilities": agent.capabilities,
            "message_types": sorted(agent.message_types),
        }

    @property
    def error_rate(self) -> float:
        return self.errors / self.processed if self.processed else 0.0


class Router:
    def __init__(self, traces: TraceStore, retries: int = 2, backoff_s: float = 0.05, timeout_s: float = 30.0) -> None:
        self.traces = traces
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self.agents: dict[str, Agent] = {}
        self.stats: dict[str, AgentStats] = {}

    def register(self, agent: Agent) -> None:
        self.agents[agent.agent_id] = agent
        self.stats[agent.agent_id] = AgentStats()

    def health(self, agent_id: str) -> dict[str, Any] | None:
        agent = self.agents.get(agent_id)
        return None if agent is None else self.stats[agent_id].health(agent)

    async def error(
        self,
        code: ErrorCode,
        text: str,
        original: dict | Message,
        trace_id: str | None = None,
        to: str | None = None,
        retry_after_s: int | None = None,
    ) -> Message:
        """An ERROR_MESSAGE from the router about ``original`` (a Message or what was sent)."""
        raw = original.model_dump() if isinstance(original, Message) else original
        kind = _fits(raw.get("type"), 64) or "unknown"
        trace = trace_id or _fits(raw.get("trace_id"), 200)
        trace = trace or await self.traces.new_trace_id("ERROR_MESSAGE")
        retry, action = ERRORS[code]
        payload = ErrorPayload(
            error_code=code,
            error_message=text,
            original_request=OriginalRequest(type=kind, trace_id=trace),
            retry_possible=retry,
            suggested_action=action,
        )
        sender = (
            raw.get("receiver")
            if isinstance(raw.get("receiver"), str) and raw["receiver"] in self.agents
            else ROUTER_ID
        )
        receiver = to or (raw.get("sender") if isinstance(raw.get("sender"), str) else "unknown")
        return Message(
            type="ERROR_MESSAGE",
            sender=sender,
            receiver=receiver[:128] or "unknown",
            trace_id=trace,
            payload=payload.model_dump(mode="json"),
            metadata={} if retry_after_s is None else {"retry_after_s": retry_after_s},
        )

    async def refuse(self, code: ErrorCode, text: str, raw: Any) -> Message:
        """An error about a message that never reached an agent, stored with what was sent."""
        with _message_span(raw) as span:
            reply = await self.error(code, text, raw if isinstance(raw, dict) else {})
            self.traces.add(reply, outcome=code.value)
            _answered(span, reply)
        return reply

    async def send(self, raw: dict | Message) -> Message:
        """Route one message and return the reply (an ERROR_MESSAGE when anything fails), in an
        OpenTelemetry span of its own (:func:`_message_span`)."""
        with _message_span(raw) as span:
            reply = await self._route(raw)
            _answered(span, reply)
        return reply

    async def _route(self, raw: dict | Message) -> Message:
        started = time.perf_counter()
        try:
            message = raw if isinstance(raw, Message) else Message.model_validate(raw)
        except ValidationError as exc:
            return await self.refuse(ErrorCode.INVALID_MESSAGE, problems(exc, "message"), raw)
        if message.trace_id is None:
            conversation = message.metadata.get("conversation_id")
            message.trace_id = await self.traces.new_trace_id(
                message.type, conversation if isinstance(conversation, str) else None
            )
        model = PAYLOADS.get(message.type)
        agent = self.agents.get(message.receiver)
        problem = None
        if model is None:
            problem = (
                ErrorCode.UNKNOWN_MESSAGE_TYPE,
                f"unknown message type {message.type!r}; known: {sorted(PAYLOADS)}",
            )
        elif agent is None:
            problem = (ErrorCode.UNKNOWN_RECEIVER, f"no agent {message.receiver!r}; agents: {sorted(self.agents)}")
        elif message.type not in agent.message_types:
            problem = (
                ErrorCode.UNKNOWN_MESSAGE_TYPE,
                f"{agent.agent_id} does not handle {message.type}; it handles {sorted(agent.message_types)}",
            )
        if problem is None:
            try:
                payload = model.model_validate(message.payload)
            except ValidationError as exc:
                problem = (ErrorCode.INVALID_MESSAGE, f"payload: {problems(exc, 'message')}")
        self.traces.add(message, outcome="received" if problem is None else problem[0].value)
        if problem is not None:
            reply = await self.error(*problem, message)
            self.traces.add(reply, outcome=problem[0].value)
            return reply
        reply = await self._deliver(agent, message, payload)
        elapsed = (time.perf_counter() - started) * 1000
        stats = self.stats[agent.agent_id]
        stats.processed += 1
        stats.errors += reply.type == "ERROR_MESSAGE"
        stats.total_ms += elapsed
        stats.last_heartbeat = datetime.now(UTC)
        self.traces.add(
            reply, outcome="ok" if reply.type != "ERROR_MESSAGE" else reply.payload["error_code"], duration_ms=elapsed
        )
        return reply

    async def _deliver(self, agent: Agent, message: Message, payload: BaseModel) -> Message:
        """The agent's reply. A retryable failure is tried again after a backoff, but a timeout is
        answered at once: the timed-out try may still be running (an agent's thread cannot be
        cancelled), so a second try would run beside it, doubling the load on a server already too
        slow, while the sender, having waited one time limit, waits another. As with gRPC deadlines,
        the sender decides: TIMEOUT says ``retry_possible``, to retry later after its own backoff."""
        for attempt in range(self.retries + 1):
            work = asyncio.ensure_future(agent.handle(message, payload))
            try:
                kind, body = await asyncio.wait_for(asyncio.shield(work), timeout=self.timeout_s)
                return Message(
                    type=kind,
                    sender=agent.agent_id,
                    receiver=message.sender,
                    trace_id=message.trace_id,
                    payload=body.model_dump(mode="json"),
                )
            except TimeoutError:
                left_running(work)
                failure = AgentError(ErrorCode.TIMEOUT, f"{agent.agent_id} took longer than {self.timeout_s:g} s")
            except AgentError as exc:
                failure = exc
            except Exception as exc:  # an agent's bug must come back as an error message, not a crash
                log.exception("agent %s failed on %s", agent.agent_id, message.trace_id)
                failure = AgentError(ErrorCode.INTERNAL, f"{agent.agent_id} failed: {type(exc).__name__}")
            if failure.code is ErrorCode.TIMEOUT or not ERRORS[failure.code][0] or attempt == self.retries:
                break
            await asyncio.sleep(self.backoff_s * 2**attempt)
        return await self.error(
            failure.code, str(failure), message, message.trace_id, retry_after_s=failure.retry_after_s
        )


_overruns: ContextVar[list[asyncio.Future] | None] = ContextVar("overruns", default=None)


@contextlib.contextmanager
def overruns() -> Iterator[list[asyncio.Future]]:
    """The agent work that replies sent inside the block left running past their time limit (an
    agent's thread cannot be stopped), so that the caller can hold what that work still uses (an
    admission slot) until it really ends."""
    found: list[asyncio.Future] = []
    token = _overruns.set(found)
    try:
        yield found
    finally:
        _overruns.reset(token)


def left_running(work: asyncio.Future) -> None:
    """Count ``work`` among the enclosing :func:`overruns` block's (when inside one): what a door's
    admission slot waits for before it is given back."""
    work.add_done_callback(lambda done: done.cancelled() or done.exception())  # its late failure is not news
    found = _overruns.get()
    if found is not None:
        found.append(work)


def _fits(value: object, limit: int) -> str | None:
    """``value`` when it is a string an envelope field can carry back (1 to ``limit`` characters)."""
    return value if isinstance(value, str) and 0 < len(value) <= limit else None


@contextlib.contextmanager
def _message_span(raw: object):
    """A span ``message <TYPE>`` with the sender's and receiver's names as sent; the trace store
    rows written inside it carry its OpenTelemetry trace id."""
    fields = raw.model_dump(include={"type", "sender", "receiver"}) if isinstance(raw, Message) else raw
    fields = fields if isinstance(fields, dict) else {}
    kind = _fits(fields.get("type"), 64) or "unknown"
    attributes = {"protocol.message.type": kind}
    for name in ("sender", "receiver"):
        if _fits(fields.get(name), 128):
            attributes[f"protocol.{name}"] = fields[name]
    with tracer.start_as_current_span(f"message {kind}", attributes=attributes) as span:
        yield span


def _answered(span: Span, reply: Message) -> None:
    """The protocol's trace id, the reply's type and, for an ERROR_MESSAGE, its code."""
    span.set_attributes({"protocol.trace_id": reply.trace_id or "", "protocol.reply.type": reply.type})
    if reply.type == "ERROR_MESSAGE":
        code = reply.payload["error_code"]
        span.set_attributes({"protocol.error_code": code, "error.type": code})
        span.set_status(StatusCode.ERROR, code)
