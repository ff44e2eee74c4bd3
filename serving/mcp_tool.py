"""The MCP server: tool ``search_nfcorpus`` over streamable HTTP (``/mcp``) or stdio.

The HTTP app also carries the REST twin ``POST /search_nfcorpus`` (the way the benchmark's own
MCP service is called), ``GET /health`` and ``GET /metrics``.
"""

import io
import json
import logging
import os
import sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.pipeline import Hit
from serving.search_service import BadRequest, QueryTimeout, SearchRequest, SearchService

log = logging.getLogger(__name__)
TOOL_NAME = "search_nfcorpus"


class SearchResult(BaseModel):
    doc_id: str = Field(description="corpus document id, e.g. MED-123")
    score: float = Field(description="final relevance score (fusion and reranker blended when reranking is on)")
    title: str
    text: str


class SearchResponse(BaseModel):
    results: list[SearchResult]


def to_response(hits: list[Hit]) -> SearchResponse:
    return SearchResponse(
        results=[SearchResult(doc_id=h.doc_id, score=h.score, title=h.title, text=h.text) for h in hits]
    )


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
        except (BadRequest, QueryTimeout) as exc:
            raise ToolError(str(exc)) from None

    @server.custom_route("/search_nfcorpus", methods=["POST"])
    async def rest_search(request: Request) -> Response:
        try:
            payload = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, 'body must be JSON like {"query": "...", "top_k": 5}')
        try:
            hits = await service.search(SearchRequest.parse(payload, max_chars), door="rest")
        except BadRequest as exc:
            return _error(422, str(exc))
        except QueryTimeout as exc:
            return _error(504, str(exc))
        return JSONResponse(to_response(hits).model_dump())

    @server.custom_route("/health", methods=["GET"])
    async def health(request: Request) -> Response:
        return JSONResponse(service.health())

    @server.custom_route("/metrics", methods=["GET"])
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    return server


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


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
