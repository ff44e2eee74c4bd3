"""The MCP server over streamable HTTP (``/mcp``) or stdio, and the REST routes beside it.

Tools: ``search_nfcorpus`` (the benchmark's, unchanged), ``search`` (filters, threshold, chunk
fields) and, with ``--mcp-writes``, ``add_document`` / ``delete_document``. REST: ``POST
/search_nfcorpus`` (the benchmark's twin), ``POST /search``, ``/documents`` (POST, and GET /
DELETE by id), ``GET /health`` and ``GET /metrics``.
"""

import functools
import io
import json
import logging
import os
import sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agents.chat_responder import GenerationFailed
from engine.live import DocumentNotFound, NotYetSearchable
from engine.wal import StorageFull
from serving.admission import Overloaded
from serving.openapi import openapi_document
from serving.protocol_routes import ProtocolDoor, load_keys
from serving.replies import ChunkResponse, SearchResponse, to_chunks, to_response
from serving.search_service import REFRESH, BadRequest, QueryTimeout, ReadOnly, SearchRequest, SearchService

log = logging.getLogger(__name__)
TOOL_NAME = "search_nfcorpus"
SOLVER_PATH = "/api/a2a/purple-agent"


def build_mcp_server(service: SearchService) -> MCPServer:
    """An MCP server exposing the engine; errors reach the client as tool errors, never crashes."""
    server = MCPServer(
        name="hybrid-search",
        instructions="Search NFCorpus medical abstracts with hybrid BM25 + dense retrieval and reranking.",
        version="0.1.0",
    )
    max_chars = service.settings.max_query_chars

    @server.tool(name=TOOL_NAME, description="Find the NFCorpus documents most relevant to a plain-English query.")
    async def search_nfcorpus(
        query: Annotated[str, Field(min_length=1, max_length=max_chars, description="the question")],
        top_k: Annotated[int, Field(ge=1, le=100, description="number of documents to return")] = 5,
    ) -> SearchResponse:
        try:
            request = SearchRequest.parse({"query": query, "top_k": top_k}, max_chars)
            return to_response(await service.search(request, door="mcp"))
        except (BadRequest, QueryTimeout, Overloaded) as exc:
            raise ToolError(str(exc)) from None

    @server.tool(
        name="search",
        description="Search the index's chunks, optionally narrowed by filters (document_types, date_range"
        " [from, to], document_ids, or equality on any metadata key) and a similarity_threshold (0-1).",
    )
    async def search(
        query: Annotated[str, Field(min_length=1, max_length=max_chars, description="the question")],
        top_k: Annotated[int, Field(ge=1, le=100, description="number of chunks to return")] = 5,
        filters: Annotated[dict | None, Field(description='e.g. {"document_types": ["guideline"]}')] = None,
        similarity_threshold: Annotated[float | None, Field(ge=0, le=1)] = None,
    ) -> ChunkResponse:
        payload = {"query": query, "top_k": top_k, "filters": filters, "similarity_threshold": similarity_threshold}
        try:
            return to_chunks(await service.search(SearchRequest.parse(payload, max_chars), door="mcp"))
        except (BadRequest, QueryTimeout, Overloaded) as exc:
            raise ToolError(str(exc)) from None

    if service.settings.mcp_writes:

        @server.tool(name="add_document", description="Add a document with its chunks, or replace it whole.")
        async def add_document(
            document_id: str, chunks: list[dict], document_name: str = "", metadata: dict | None = None
        ) -> dict:
            payload = {"document_id": document_id, "document_name": document_name, "chunks": chunks}
            try:
                return await service.upsert({**payload, "metadata": metadata or {}}, wait=True)
            except (BadRequest, ReadOnly, Overloaded, StorageFull, NotYetSearchable) as exc:
                raise ToolError(str(exc)) from None

        @server.tool(name="delete_document", description="Delete a document and all its chunks.")
        async def delete_document(document_id: str) -> dict:
            try:
                return await service.delete(document_id, wait=True)
            except DocumentNotFound:
                raise ToolError(f"no document {document_id!r}") from None
            except (ReadOnly, StorageFull, NotYetSearchable) as exc:
                raise ToolError(str(exc)) from None

    def search_route(respond):
        @_rest
        async def rest_search(request: Request) -> Response:
            payload = await _json_body(request, service.settings.max_body_bytes)
            hits = await service.search(SearchRequest.parse(payload, max_chars), door="rest")
            return JSONResponse(respond(hits).model_dump())

        return rest_search

    server.custom_route("/search_nfcorpus", methods=["POST"])(search_route(to_response))
    server.custom_route("/search", methods=["POST"])(search_route(to_chunks))

    @server.custom_route("/documents", methods=["POST"])
    @_rest
    async def post_document(request: Request) -> Response:
        payload = await _json_body(request, service.settings.max_body_bytes)
        ack = await service.upsert(payload, wait=_waits(request))
        return JSONResponse(ack, status_code=200 if ack["replaced"] else 201)

    @server.custom_route("/documents/{document_id:path}", methods=["GET", "DELETE"])
    @_rest
    async def one_document(request: Request) -> Response:
        document_id = request.path_params["document_id"]
        if request.method == "GET":
            return JSONResponse(await service.document(document_id))
        return JSONResponse(await service.delete(document_id, wait=_waits(request)))

    settings = service.settings
    door = ProtocolDoor(
        service.router,
        load_keys(settings.agent_keys, settings.agent_rate),
        settings.agent_rate,
        settings.max_message_bytes,
        settings.max_body_bytes,
        service.admission,
    )
    for route in door.routes():
        server.custom_route(route.path, methods=sorted(route.methods - {"HEAD"}))(route.endpoint)

    @server.custom_route(SOLVER_PATH, methods=["GET"])
    async def solver_card(request: Request) -> Response:
        return JSONResponse(service.solver.describe())

    @server.custom_route(SOLVER_PATH, methods=["POST"])
    @_rest
    async def solve(request: Request) -> Response:
        return JSONResponse(await service.solve(await _json_body(request, settings.max_body_bytes)))

    @server.custom_route("/health", methods=["GET"])
    async def health(request: Request) -> Response:
        return JSONResponse({**service.health(), "agent_protocol": door.describe()})

    spec = openapi_document(settings, keyed_protocol=bool(door.keys))

    @server.custom_route("/openapi.json", methods=["GET"])
    async def openapi(request: Request) -> Response:
        return JSONResponse(spec)

    @server.custom_route("/metrics", methods=["GET"])
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    return server


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _rest(handler):
    """A REST handler whose errors become ``{"error": ...}`` with the status each kind means."""

    @functools.wraps(handler)
    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except _HttpError as exc:
            return _error(exc.status, str(exc))
        except BadRequest as exc:
            return _error(422, str(exc))
        except DocumentNotFound as exc:
            return _error(404, f"no document {exc.args[0]!r}")
        except ReadOnly as exc:
            return _error(405, str(exc))
        except QueryTimeout as exc:
            return _error(504, str(exc))
        except GenerationFailed as exc:
            return _error(502, str(exc))
        except StorageFull as exc:  # nothing was logged: the caller may retry once there is room
            return _error(507, str(exc))
        except NotYetSearchable as exc:  # logged and kept, but ?refresh=wait_for could not be honoured
            return _error(503, str(exc))
        except Overloaded as exc:
            return JSONResponse({"error": str(exc)}, 503, headers={"Retry-After": str(exc.retry_after_s)})

    return answer


class _HttpError(ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _json_body(request: Request, limit: int) -> object:
    """The body as JSON: 413 past ``limit`` bytes (read no further), 400 when it is not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _HttpError(413, f"body is {int(declared):,} bytes; the limit is {limit:,}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise _HttpError(413, f"body is over the limit of {limit:,} bytes")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise _HttpError(400, "body must be JSON (UTF-8)") from None


def _waits(request: Request) -> bool:
    """``?refresh=wait_for`` (as Elasticsearch spells it): answer once the change is searchable."""
    unknown = sorted(set(request.query_params) - {"refresh"})
    if unknown:
        raise _HttpError(422, f"unknown query parameter {unknown[0]!r}; this route takes only 'refresh'")
    refresh = request.query_params.get("refresh", "false")
    if refresh not in REFRESH:
        raise _HttpError(422, f"refresh must be one of {', '.join(REFRESH)}, got {refresh!r}")
    return refresh in ("wait_for", "true")


def run_stdio(settings) -> None:
    """Serve the tool over stdin/stdout.

    The JVM and native libraries print to file descriptor 1, which would corrupt the protocol
    stream, so fd 1 is pointed at stderr and the protocol gets a private copy of the real stdout.
    """
    import anyio

    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = io.TextIOWrapper(os.fdopen(protocol_fd, "wb"), encoding="utf-8", line_buffering=True)
    service = SearchService(settings)
    anyio.run(build_mcp_server(service).run_stdio_async)
