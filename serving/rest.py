"""The REST door: ``POST /search_nfcorpus`` (the MCP tool's twin), ``POST /search``, ``/documents``
(POST, and GET / DELETE by id), the benchmark solver, ``/health``, ``/metrics``, ``/openapi.json``
and the agent protocol's ``/v1`` routes, declared as one route list.

Every error answers ``{"error": ...}`` with the status its kind carries (a
:class:`~engine.errors.ServiceError`, by the app's exception handler: :func:`serving.replies.json_errors`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.documents import SEARCH_TOOL
from serving.openapi import openapi_document
from serving.protocol_routes import ProtocolDoor
from serving.replies import to_chunks, to_response
from serving.requests import BadRequest, json_body, validated
from serving.search_service import REFRESH, SearchService

SOLVER_PATH = "/api/a2a/purple-agent"
Handler = Callable[[Request], Awaitable[Response]]


def routes(service: SearchService, door: ProtocolDoor) -> list[Route]:
    """Every REST route of a server around ``service``; ``door`` serves the agent protocol."""
    settings = service.settings
    limit = settings.serving.max_body_bytes
    spec = openapi_document(settings, service.search_request, keyed_protocol=bool(door.keys))

    def search(respond) -> Handler:
        async def handler(request: Request) -> Response:
            query = validated(service.search_request, await json_body(request, limit))
            answer = respond(await service.search(query, door="rest"))
            return Response(answer.model_dump_json(), media_type="application/json")  # serialized once

        return handler

    async def post_document(request: Request) -> Response:
        ack = await service.upsert(await json_body(request, limit), wait=_waits(request))
        return JSONResponse(ack, status_code=200 if ack["replaced"] else 201)

    async def get_document(request: Request) -> Response:
        return JSONResponse(await service.document(request.path_params["document_id"]))

    async def delete_document(request: Request) -> Response:
        return JSONResponse(await service.delete(request.path_params["document_id"], wait=_waits(request)))

    async def solver_card(request: Request) -> Response:
        return JSONResponse(service.solver.describe())

    async def solve(request: Request) -> Response:
        return JSONResponse(await service.solve(await json_body(request, limit)))

    async def health(request: Request) -> Response:
        return JSONResponse({**service.health(), "agent_protocol": door.describe()})

    async def openapi(request: Request) -> Response:
        return JSONResponse(spec)

    async def metrics(request: Request) -> Response:  # off the event loop: a worker of several asks its siblings
        return Response(await run_in_threadpool(service.exposition), media_type=CONTENT_TYPE_LATEST)

    return [
        Route(f"/{SEARCH_TOOL}", search(to_response), methods=["POST"]),
        Route("/search", search(to_chunks), methods=["POST"]),
        Route("/documents", post_document, methods=["POST"]),
        Route("/documents/{document_id:path}", get_document, methods=["GET"]),
        Route("/documents/{document_id:path}", delete_document, methods=["DELETE"]),
        Route(SOLVER_PATH, solver_card, methods=["GET"]),
        Route(SOLVER_PATH, solve, methods=["POST"]),
        *door.routes(),
        Route("/health", health, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def _waits(request: Request) -> bool:
    """``?refresh=wait_for`` (as Elasticsearch spells it): answer once the change is searchable."""
    unknown = sorted(set(request.query_params) - {"refresh"})
    if unknown:
        raise BadRequest(f"unknown query parameter {unknown[0]!r}; this route takes only 'refresh'")
    refresh = request.query_params.get("refresh", "false")
    if refresh not in REFRESH:
        raise BadRequest(f"refresh must be one of {', '.join(REFRESH)}, got {refresh!r}")
    return refresh in ("wait_for", "true")
