"""``GET /openapi.json``: the HTTP routes of the MCP + REST port as an OpenAPI 3.1 document.

Bodies and replies come from the same pydantic models the routes validate and answer with, so the
document cannot drift from the code silently; schemathesis reads it to fuzz every route
(``benchmarks.reliability``). The MCP endpoint (``/mcp``) speaks JSON-RPC and is described by
its own ``tools/list``; the A2A port by its agent card.
"""

from __future__ import annotations

from pydantic import BaseModel

from agents.messages import Message
from agents.solver import SolverRequest
from agents.system import RagRequest
from engine.documents import SEARCH_TOOL, DocumentIn, SearchRequest
from serving.replies import ChunkResponse, SearchResponse
from serving.search_service import REFRESH
from serving.settings import Settings

ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
OBJECT = {"type": "object"}


class _Spec:
    """Collects component schemas while the paths are written."""

    def __init__(self) -> None:
        self.components: dict[str, dict] = {"Error": ERROR}

    def ref(self, model: type[BaseModel]) -> dict:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        self.components.update(schema.pop("$defs", {}))
        self.components[model.__name__] = schema
        return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _ok(schema: dict, description: str, status: int = 200) -> dict:
    return {str(status): _json(schema, description)}


def _errors(*statuses: int, schema: dict | None = None) -> dict:
    what = {
        400: "body is not JSON",
        401: "no or unknown key",
        403: "not allowed for this key or client",
        404: "not found",
        405: "the server is read-only",
        413: "body over the size limit",
        422: "the message names the field that is wrong",
        429: "over the agent's rate; Retry-After says when",
        502: "the LLM server failed and fallback is off",
        503: "at capacity (admission control): Retry-After says when",
        504: "took longer than the query timeout",
        507: "no space left to log the write",
    }
    body = schema or {"$ref": "#/components/schemas/Error"}
    return {str(s): _json(body, what[s]) for s in statuses}


def _op(summary: str, ok: dict, errors: dict, body: dict | None = None, **extra) -> dict:
    op = {"summary": summary, "responses": {**ok, **errors}, **extra}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


def openapi_document(settings: Settings, search_request: type[SearchRequest], keyed_protocol: bool) -> dict:
    """The document for this server's settings (``search_request`` holds its query limit): security
    is declared where this server enforces it (``/v1`` with agent keys; every door but health,
    metrics and this document with ``--key-all-doors``)."""
    spec = _Spec()
    search_body = spec.ref(search_request)
    document_id = [{"name": "document_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    refresh = [{"name": "refresh", "in": "query", "schema": {"enum": list(REFRESH)}}]
    busy = (503, 504)
    message = spec.ref(Message)
    refusals = _errors(401, 403, 413, 422, 429, 503, 504, schema=message)
    turn_refusals = _errors(401, 403, 413, 422, 429, 503, 504, schema={"anyOf": [message, OBJECT]})
    paths = {
        **{
            path: {"post": _op(summary, _ok(spec.ref(reply), what), _errors(400, 413, 422, *busy), search_body)}
            for path, summary, reply, what in (
                (f"/{SEARCH_TOOL}", "Top documents for a query (the MCP tool's twin)", SearchResponse, "documents"),
                ("/search", "Top chunks for a query, with filters and a threshold", ChunkResponse, "ranked chunks"),
            )
        },
        "/documents": {
            "post": _op(
                "Add a document (201) or replace it whole (200)",
                {**_ok(OBJECT, "replaced"), **_ok(OBJECT, "created", 201)},
                _errors(400, 405, 413, 422, 503, 507),
                spec.ref(DocumentIn),
                parameters=refresh,
            )
        },
        "/documents/{document_id}": {
            "get": _op("A document with its chunks", _ok(OBJECT, "the document"), _errors(404), parameters=document_id),
            "delete": _op(
                "Delete a document and its chunks",
                _ok(OBJECT, "deleted"),
                _errors(404, 405, 422, 507),
                parameters=document_id + refresh,
            ),
        },
        "/api/a2a/purple-agent": {
            "get": _op("The solver's card: its input and rules", _ok(OBJECT, "card"), {}),
            "post": _op(
                "Solve a benchmark task under a policy",
                _ok(OBJECT, "answers with policy metadata"),
                _errors(400, 413, 422, 502, *busy),
                spec.ref(SolverRequest),
            ),
        },
        "/v1/messages": {
            "post": _op("Send a typed message through the router", _ok(message, "the reply message"), refusals, message)
        },
        "/v1/rag": {
            "post": _op(
                "One retrieval + answer turn",
                _ok(OBJECT, "the turn's messages"),
                turn_refusals,
                spec.ref(RagRequest),
            )
        },
        "/v1/schemas": {"get": _op("JSON Schema of every message type", _ok(OBJECT, "schemas"), {})},
        "/v1/agents": {"get": _op("The agents and their health", _ok(OBJECT, "agents"), {})},
        "/v1/agents/{agent_id}/health": {
            "get": _op(
                "One agent's health",
                _ok(OBJECT, "health"),
                _errors(404),
                parameters=[{"name": "agent_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            )
        },
        "/v1/traces": {
            "get": _op(
                "Recent traces (loopback clients only)",
                _ok(OBJECT, "traces"),
                _errors(403, 422),
                parameters=[
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}},
                    {"name": "agent", "in": "query", "schema": {"type": "string"}},
                    {"name": "type", "in": "query", "schema": {"type": "string"}},
                    {"name": "errors", "in": "query", "schema": {"enum": ["1", "true", "0", "false"]}},
                ],
            )
        },
        "/v1/traces/{trace_id}": {
            "get": _op(
                "One trace's messages (loopback clients only)",
                _ok(OBJECT, "messages"),
                _errors(403, 404),
                parameters=[{"name": "trace_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            )
        },
        "/ui": {
            "get": _op(
                "The trace viewer (loopback clients only)",
                {"200": {"description": "page", "content": {"text/html": {"schema": {"type": "string"}}}}},
                _errors(403),
            )
        },
        "/health": {"get": _op("Liveness and what is loaded", _ok(OBJECT, "health"), {})},
        "/metrics": {
            "get": _op(
                "Prometheus metrics",
                {"200": {"description": "metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}},
                {},
            )
        },
    }
    bearer = [{"agentKey": []}]
    for path, operations in paths.items():
        keyed = settings.security.key_all_doors and not path.startswith(("/health", "/metrics", "/v1/"))
        keyed |= keyed_protocol and path in ("/v1/messages", "/v1/rag")
        for op in operations.values():
            if keyed:
                op["security"] = bearer
                op["responses"].setdefault("401", _errors(401)["401"])
    return {
        "openapi": "3.1.0",
        "info": {"title": "hybrid-search", "version": "0.1.0", "description": __doc__.split("\n\n")[0]},
        "paths": paths,
        "components": {
            "schemas": spec.components,
            "securitySchemes": {"agentKey": {"type": "http", "scheme": "bearer", "description": "an agent key"}},
        },
    }
