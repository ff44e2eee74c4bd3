"""``GET /openapi.json``: the HTTP routes of the MCP + REST port as an OpenAPI 3.1 document.

Written from the route table (:func:`serving.rest.routes`), whose entries say all the document needs:
bodies and replies are the pydantic models the routes validate and answer with, so a route cannot be
served undocumented, nor the document drift from the code silently. Schemathesis reads it to fuzz
every route (``benchmarks.reliability``). The MCP endpoint (``/mcp``) is described by its own
``tools/list``; the A2A port by its agent card.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NamedTuple

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, compile_path

from engine.errors import ServiceError
from serving.rerank_api import PATHS as RERANK_PATHS

Handler = Callable[[Request], Awaitable[Response]]
JSON = "application/json"
Schema = type[BaseModel] | dict | tuple | str  # a model, a JSON Schema, any of a tuple's, a text reply's media type
OBJECT = {"type": "object"}
TEXT = {"type": "string"}
ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
ERROR_REF = {"$ref": "#/components/schemas/Error"}
OPEN = ("/health", "/metrics", "/openapi.json", "/.well-known/", "/v1/")  # --key-all-doors leaves these open
KEYED = RERANK_PATHS  # ... but not these: /v1 is the agent protocol's, which keys its own


def unkeyed(path: str) -> bool:
    """Whether ``--key-all-doors`` leaves ``path`` open (app.KeyGate, and this document)."""
    return path.startswith(OPEN) and path not in KEYED
WHAT = {  # what an error status tells a caller, whichever failure answers it
    400: "body is not JSON",
    401: "no or unknown key",
    403: "not allowed for this key or client",
    404: "not found",
    405: "the server is read-only",
    409: "not possible in the index's state now (the message says why)",
    413: "body over the size limit",
    422: "the message names the field that is wrong",
    429: "over the agent's rate; Retry-After says when",
    502: "the LLM server failed and fallback is off",
    503: "at capacity (admission control): Retry-After says when",
    504: "took longer than the query timeout",
    507: "no space left to log the write",
}


class Op(NamedTuple):
    """A route of the REST port and what the document says of it, declared together once."""

    route: str  # "METHOD /path", the path Starlette's: its parameters are the operation's path parameters
    endpoint: Handler
    summary: str
    replies: str | dict[int, str]  # what a 200 answers, or each success status with what it answers
    errors: tuple[int | type[ServiceError], ...] = ()  # a status, or a failure whose kind carries its status
    query: dict[str, dict] = {}  # query parameters, each with its schema
    reply: Schema = OBJECT
    body: type[BaseModel] | None = None
    refusal: Schema = ERROR_REF  # what an error answers

    def to_route(self) -> Route:
        method, path = self.route.split(" ")
        return Route(path, self.endpoint, methods=[method])


class _Components:
    """Collects the component schemas while the operations are written: each model once, shared."""

    def __init__(self) -> None:
        self.schemas: dict[str, dict] = {"Error": ERROR}

    def content(self, what: Schema, description: str) -> dict:
        media = what if isinstance(what, str) else JSON
        return {"description": description, "content": {media: {"schema": self.schema(what)}}}

    def schema(self, what: Schema) -> dict:
        if isinstance(what, str):
            return TEXT
        if isinstance(what, tuple):
            return {"anyOf": [self.schema(one) for one in what]}
        if isinstance(what, dict):
            return what
        schema = what.model_json_schema(ref_template="#/components/schemas/{model}")
        self.schemas.update(schema.pop("$defs", {}))
        self.schemas[what.__name__] = schema
        return {"$ref": f"#/components/schemas/{what.__name__}"}


def openapi_document(operations: list[Op], key_all_doors: bool, keyed_protocol: bool) -> dict:
    """The document of ``operations``: security is declared where this server enforces it (with agent
    keys, on the routes that can answer 401: the agent protocol checks keys itself; with
    ``--key-all-doors``, on every door but health, metrics, ``/v1`` and this document)."""
    components, paths = _Components(), {}
    for op in operations:
        method, route = op.route.split(" ")
        _, path, convertors = compile_path(route)
        parameters = [{"name": name, "in": "path", "required": True, "schema": TEXT} for name in convertors]
        parameters += [{"name": name, "in": "query", "schema": schema} for name, schema in op.query.items()]
        replies = op.replies if isinstance(op.replies, dict) else {200: op.replies}
        responses = {str(status): components.content(op.reply, what) for status, what in replies.items()}
        for error in op.errors:
            status = error if isinstance(error, int) else error.status
            responses[str(status)] = components.content(op.refusal, WHAT[status])
        doc = {"summary": op.summary} | ({"parameters": parameters} if parameters else {})
        if op.body is not None:
            doc["requestBody"] = {"required": True, "content": {JSON: {"schema": components.schema(op.body)}}}
        if key_all_doors and not unkeyed(path) or keyed_protocol and 401 in op.errors:
            doc["security"] = [{"agentKey": []}]
            responses.setdefault("401", components.content(ERROR_REF, WHAT[401]))
        paths.setdefault(path, {})[method.lower()] = doc | {"responses": responses}
    return {
        "openapi": "3.1.0",
        "info": {"title": "hybrid-search", "version": "0.1.0", "description": __doc__.split("\n\n")[0]},
        "paths": paths,
        "components": {
            "schemas": components.schemas,
            "securitySchemes": {"agentKey": {"type": "http", "scheme": "bearer", "description": "an agent key"}},
        },
    }
