"""The agent message protocol over HTTP: ``/v1/messages``, ``/v1/rag``, schemas, agents, traces.

Who may send: with an agent-keys file (``--agent-keys``), every request carries ``Authorization:
Bearer <key>``; the key names the agent, so a message whose ``sender`` is another agent, or whose
type that agent may not send, is FORBIDDEN. Keys are stored as SHA-256 hashes. Without a keys
file only loopback clients are served. Each agent has a rate limit (``limits``' moving window; 429
with ``Retry-After``), and bodies have size limits (ingestion's larger). Every accepted and
refused message is in the trace store and the audit log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import tomllib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from limits import parse, storage, strategies
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from agents.messages import ErrorCode, Message, schemas
from agents.router import ROUTER_ID, Router, overruns
from agents.system import SYSTEM_ID, RagRequest, rag_turn
from serving.admission import Admission, Overloaded
from serving.openapi import OBJECT, TEXT, Op
from serving.requests import BadRequest, BodyError, bearer, parse_json, read_body, validated

audit = logging.getLogger("hybrid_search.audit")
_VIEWER = Path(__file__).with_name("trace_viewer.html")
LOOPBACK = {"127.0.0.1", "::1", "localhost"}
STATUS = {
    ErrorCode.INVALID_MESSAGE: 422,
    ErrorCode.UNKNOWN_MESSAGE_TYPE: 422,
    ErrorCode.UNKNOWN_RECEIVER: 404,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.RATE_LIMITED: 429,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.TIMEOUT: 504,
    ErrorCode.OVERLOADED: 503,
    ErrorCode.INTERNAL: 500,
}
REFUSALS = (401, 403, 413, 422, 429, 503, 504)  # what a message or a turn is refused with, at the door or in it


@dataclass
class AgentKey:
    agent_id: str
    sha256: str
    message_types: frozenset[str]
    rate: str


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_keys(path: Path | None, default_rate: str) -> dict[str, AgentKey]:
    """``[agents.<id>]`` tables with ``key_sha256``, ``message_types`` and an optional ``rate``."""
    if path is None:
        return {}
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"agent keys {path}: {exc}") from None
    keys = {}
    for agent_id, entry in (data.get("agents") or {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("key_sha256"), str):
            raise ValueError(f"agent keys {path}: [agents.{agent_id}] needs key_sha256")
        rate = entry.get("rate", default_rate)
        parse(rate)  # a bad rate string fails at start, not at the first request
        types = frozenset(entry.get("message_types") or [])
        keys[entry["key_sha256"]] = AgentKey(agent_id, entry["key_sha256"], types, rate)
    return keys


class ProtocolDoor:
    """The HTTP side of one router: who may send, how much, how big; then the router decides."""

    def __init__(
        self,
        router: Router,
        keys: dict[str, AgentKey],
        default_rate: str = "120/minute",
        max_message_bytes: int = 256 << 10,
        max_ingestion_bytes: int = 8 << 20,
        admission: Admission | None = None,
    ) -> None:
        self.router, self.keys, self.admission = router, keys, admission
        self.default_rate = default_rate
        self.max_message_bytes, self.max_ingestion_bytes = max_message_bytes, max_ingestion_bytes
        self._limiter = strategies.MovingWindowRateLimiter(storage.MemoryStorage())

    def describe(self) -> dict:
        return {"auth": "agent keys" if self.keys else "loopback only (no agent keys configured)"}

    def operations(self) -> list[Op]:
        """The ``/v1`` routes and ``/ui``, as the REST door's table declares its own (:mod:`serving.rest`)."""
        count = {"type": "integer", "minimum": 1, "maximum": 500}
        traces = {"limit": count, "agent": TEXT, "type": TEXT, "errors": {"enum": ["1", "true", "0", "false"]}}
        return [
            Op(
                "POST /v1/messages",
                self.post_message,
                "Send a typed message through the router",
                "the reply message",
                REFUSALS,
                reply=Message,
                body=Message,
                refusal=Message,
            ),
            Op(
                "POST /v1/rag",
                self.post_rag,
                "One retrieval + answer turn",
                "the turn's messages",
                REFUSALS,
                body=RagRequest,
                refusal=(Message, OBJECT),  # refused at the door, or the turn with its last message's status
            ),
            Op("GET /v1/schemas", self.get_schemas, "JSON Schema of every message type", "schemas"),
            Op("GET /v1/agents", self.get_agents, "The agents and their health", "agents"),
            Op("GET /v1/agents/{agent_id}/health", self.get_agent_health, "One agent's health", "health", (404,)),
            Op(
                "GET /v1/traces", self.get_traces, "Recent traces (loopback clients only)", "traces", (403, 422), traces
            ),
            Op(
                "GET /v1/traces/{trace_id:path}",
                self.get_trace,
                "One trace's messages (loopback clients only)",
                "messages",
                (403, 404),
            ),
            Op("GET /ui", self.get_ui, "The trace viewer (loopback clients only)", "page", (403,), reply="text/html"),
        ]

    # who is calling
    def _caller(self, request: Request) -> tuple[AgentKey | None, tuple[ErrorCode, str] | None]:
        if not self.keys:
            if _loopback(request):
                return None, None
            return None, (ErrorCode.UNAUTHORIZED, "no agent keys are configured, so only loopback clients are served")
        token = bearer(request.headers)
        if token is None:
            return None, (ErrorCode.UNAUTHORIZED, "send 'Authorization: Bearer <key>'")
        key = self.keys.get(hash_key(token))
        if key is None:
            return None, (ErrorCode.UNAUTHORIZED, "unknown key")
        return key, None

    def _limited(self, caller: str, rate: str) -> float | None:
        """Seconds to wait when ``caller`` is over its rate, else None (and the hit is counted)."""
        item = parse(rate)
        if self._limiter.hit(item, caller):
            return None
        return max(0.0, self._limiter.get_window_stats(item, caller).reset_time - time.time())

    def _reply(self, message: Message, headers: dict | None = None) -> JSONResponse:
        status = 200
        if message.type == "ERROR_MESSAGE":
            status = STATUS.get(ErrorCode(message.payload["error_code"]), 503)
            if "retry_after_s" in message.metadata:  # an agent's refusal that knows when to come back
                headers = {"Retry-After": str(message.metadata["retry_after_s"])} | (headers or {})
        return JSONResponse(message.model_dump(mode="json"), status_code=status, headers=headers)

    async def _refused(self, code: ErrorCode, text: str, raw: object, headers: dict | None = None) -> JSONResponse:
        audit.info("refused %s: %s", code.value, text)
        return self._reply(await self.router.refuse(code, text, raw), headers)

    async def _admit(self, request: Request) -> tuple[object, AgentKey | None, JSONResponse | None]:
        key, problem = self._caller(request)
        if problem:
            return None, key, await self._refused(*problem, {})
        waited = self._limited(
            key.agent_id if key else f"loopback:{request.client.host}", key.rate if key else self.default_rate
        )
        if waited is not None:
            headers = {"Retry-After": str(max(1, math.ceil(waited)))}
            return (
                None,
                key,
                await self._refused(
                    ErrorCode.RATE_LIMITED, f"over the rate of {key.rate if key else self.default_rate}", {}, headers
                ),
            )
        try:  # no further than the larger limit, ingestion's; the type decides which one applies
            body = await read_body(request, self.max_ingestion_bytes)
            raw = parse_json(body)
        except BodyError as exc:
            code = ErrorCode.PAYLOAD_TOO_LARGE if exc.status == 413 else ErrorCode.INVALID_MESSAGE
            return None, key, await self._refused(code, str(exc), {})
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "DOCUMENT_INGESTION" and len(body) > self.max_message_bytes:
            return (
                None,
                key,
                await self._refused(
                    ErrorCode.PAYLOAD_TOO_LARGE, f"a {kind or 'message'} over {self.max_message_bytes:,} bytes", raw
                ),
            )
        return raw, key, None

    @contextlib.asynccontextmanager
    async def _slot(self, door: str) -> AsyncIterator[None]:
        """An admission slot for the block, kept past it while agent work the block's replies gave
        up on still runs (a TIMEOUT reply's thread): admission sees all the work there is."""
        if self.admission is None:
            yield
            return
        async with self.admission.slot(door) as outlive:
            with overruns() as running:
                try:
                    yield
                finally:
                    for work in running:
                        outlive(work)

    # the routes
    async def post_message(self, request: Request) -> Response:
        raw, key, refused = await self._admit(request)
        if refused:
            return refused
        if key is not None and isinstance(raw, dict):
            if raw.get("sender") != key.agent_id:
                return await self._refused(
                    ErrorCode.FORBIDDEN, f"this key sends as {key.agent_id!r}, not {raw.get('sender')!r}", raw
                )
            if raw.get("type") not in key.message_types:
                return await self._refused(ErrorCode.FORBIDDEN, f"{key.agent_id} may not send {raw.get('type')!r}", raw)
        try:
            async with self._slot("messages"):
                reply = await self.router.send(raw if isinstance(raw, dict) else {"payload": raw})
        except Overloaded as exc:
            return await self._refused(ErrorCode.OVERLOADED, str(exc), raw, {"Retry-After": str(exc.retry_after_s)})
        audit.info(
            "accepted %s from %s: %s",
            raw.get("type") if isinstance(raw, dict) else "?",
            key.agent_id if key else "loopback",
            reply.type,
        )
        return self._reply(reply)

    async def post_rag(self, request: Request) -> Response:
        raw, key, refused = await self._admit(request)
        if refused:
            return refused
        if key is not None and key.agent_id != SYSTEM_ID:
            return await self._refused(
                ErrorCode.FORBIDDEN, f"only {SYSTEM_ID} runs RAG turns; this key is {key.agent_id}", {}
            )
        try:
            turn_request = validated(RagRequest, raw)
        except BadRequest as exc:
            return await self._refused(ErrorCode.INVALID_MESSAGE, str(exc), {})
        try:
            async with self._slot("rag"):
                turn = await rag_turn(self.router, turn_request)
        except Overloaded as exc:
            return await self._refused(ErrorCode.OVERLOADED, str(exc), raw, {"Retry-After": str(exc.retry_after_s)})
        last = turn["messages"][-1]
        status = 200 if last["type"] != "ERROR_MESSAGE" else STATUS.get(ErrorCode(last["payload"]["error_code"]), 503)
        return JSONResponse(turn, status_code=status)

    async def get_schemas(self, request: Request) -> Response:
        return JSONResponse(schemas())

    async def get_agents(self, request: Request) -> Response:
        return JSONResponse(
            {"router": ROUTER_ID, **self.describe(), "agents": [self.router.health(a) for a in self.router.agents]}
        )

    async def get_agent_health(self, request: Request) -> Response:
        health = self.router.health(request.path_params["agent_id"])
        if health is None:
            return JSONResponse({"error": f"no agent {request.path_params['agent_id']!r}"}, status_code=404)
        return JSONResponse(health)

    async def get_ui(self, request: Request) -> Response:
        """The trace viewer: one static page reading /v1/traces (loopback clients only)."""
        if not _loopback(request):
            return JSONResponse({"error": "the trace viewer is served to loopback clients only"}, status_code=403)
        return HTMLResponse(_VIEWER.read_text(encoding="utf-8"))

    async def get_traces(self, request: Request) -> Response:
        if not _loopback(request):
            return JSONResponse({"error": "traces are served to loopback clients only"}, status_code=403)
        q = request.query_params
        try:
            limit = min(500, max(1, int(q.get("limit", "50"))))
        except ValueError:
            return JSONResponse({"error": "'limit' must be an integer"}, status_code=422)
        traces = await asyncio.to_thread(
            self.router.traces.recent, limit, q.get("agent"), q.get("type"), q.get("errors") in ("1", "true")
        )
        return JSONResponse({"traces": traces})

    async def get_trace(self, request: Request) -> Response:
        if not _loopback(request):
            return JSONResponse({"error": "traces are served to loopback clients only"}, status_code=403)
        trace_id = request.path_params["trace_id"]
        messages = await asyncio.to_thread(self.router.traces.trace, trace_id)
        if not messages:
            return JSONResponse({"error": f"no trace {trace_id!r}"}, status_code=404)
        return JSONResponse({"trace_id": trace_id, "messages": messages})


def _loopback(request: Request) -> bool:
    return bool(request.client) and request.client.host in LOOPBACK
