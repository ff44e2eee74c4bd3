"""The REST door: ``POST /search_nfcorpus`` (the MCP tool's twin), ``POST /search``, ``/documents``,
Cohere-shaped ``/v1/rerank`` (:mod:`serving.rerank_api`), the benchmark solver, the agent
protocol's ``/v1`` routes, ``/health`` and ``/metrics``, declared as one table that the routes and
their OpenAPI document (``/openapi.json``) are both made from.

Every error answers ``{"error": ...}`` with the status its kind carries (a
:class:`~engine.errors.ServiceError`, by the app's exception handler: :func:`serving.replies.json_errors`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_type_hints

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agents.chat_responder import GenerationFailed
from agents.solver import SolverRequest
from engine.documents import SEARCH_TOOL, DocumentIn, FacetRequest
from engine.live.writer import DocumentNotFound
from engine.search import Hit
from engine.store.snapshot import SnapshotRefused
from engine.store.wal import StorageFull
from serving.admission import Overloaded
from serving.openapi import Op, openapi_document
from serving.protocol_routes import ProtocolDoor
from serving.replies import FacetResponse, to_chunks, to_facets, to_response
from serving.requests import BadRequest, json_body, validated
from serving.rerank_api import PATHS as RERANK_PATHS
from serving.rerank_api import RerankReply, RerankRequest, reply
from serving.search_service import REFRESH, NoReranker, QueryTimeout, ReadOnly, SearchService

SOLVER_PATH = "/api/a2a/purple-agent"
BODY = (400, 413, BadRequest)  # json_body's BodyError (not JSON, over the limit), then the model's check
BUSY = (Overloaded, QueryTimeout)


def routes(service: SearchService, door: ProtocolDoor) -> list[Route]:
    """Every REST route of a server around ``service``; ``door`` serves the agent protocol."""
    limit = service.settings.serving.max_body_bytes

    def search(
        path: str, body: type[BaseModel], respond: Callable[[list[Hit]], BaseModel], summary: str, what: str
    ) -> Op:
        """A search route: a ``body`` of a search model, the hits answered as the model ``respond`` returns."""

        async def handler(request: Request) -> Response:
            query = validated(body, await json_body(request, limit))
            answer = respond(await service.search(query, door="rest"))
            whole = {"missing_shards"} if answer.missing_shards is None else None  # said only when shards were
            return Response(answer.model_dump_json(exclude=whole), media_type="application/json")  # serialized once

        reply = get_type_hints(respond)["return"]
        return Op(f"POST /{path}", handler, summary, what, (*BODY, *BUSY), reply=reply, body=body)

    async def facets(request: Request) -> Response:
        asked = validated(FacetRequest, await json_body(request, limit))
        answer = to_facets(asked.key, asked.count, await service.facets(asked, door="rest"))
        return Response(answer.model_dump_json(), media_type="application/json")

    async def post_document(request: Request) -> Response:
        ack = await service.upsert(await json_body(request, limit), wait=_waits(request))
        return JSONResponse(ack, status_code=200 if ack["replaced"] else 201)

    async def get_document(request: Request) -> Response:
        return JSONResponse(await service.document(request.path_params["document_id"]))

    async def delete_document(request: Request) -> Response:
        return JSONResponse(await service.delete(request.path_params["document_id"], wait=_waits(request)))

    async def take_snapshot(request: Request) -> Response:
        return JSONResponse(await service.snapshot(), status_code=201)

    async def snapshots(request: Request) -> Response:
        listed = await run_in_threadpool(service.snapshots)
        return JSONResponse({"folder": str(service.snapshots_dir), "snapshots": listed})

    def rerank(path: str) -> Op:
        """Cohere's rerank at ``path`` (its v1 or v2, one shape)."""
        version = path.split("/")[1].removeprefix("v")

        async def handler(request: Request) -> Response:
            asked = validated(RerankRequest, await json_body(request, limit))
            answer = reply(asked, await service.rerank(asked), version)
            return Response(answer.model_dump_json(exclude_none=True), media_type="application/json")

        summary = "Rerank the caller's documents for a query (Cohere's rerank API)"
        return Op(f"POST {path}", handler, summary, "results, best first", (*BODY, NoReranker, *BUSY), reply=RerankReply, body=RerankRequest)

    async def solver_card(request: Request) -> Response:
        return JSONResponse(service.solver.describe())

    async def solve(request: Request) -> Response:
        return JSONResponse(await service.solve(await json_body(request, limit)))

    async def health(request: Request) -> Response:  # off the event loop: remote writers and shards are asked
        return JSONResponse({**await run_in_threadpool(service.health), "agent_protocol": door.describe()})

    async def metrics(request: Request) -> Response:  # off the event loop: a worker of several asks its siblings
        return Response(await run_in_threadpool(service.exposition), media_type=CONTENT_TYPE_LATEST)

    docs, refresh = "/documents/{document_id:path}", {"refresh": {"enum": list(REFRESH)}}
    table = [
        search(
            SEARCH_TOOL, service.query_request, to_response, "Top documents for a query (the MCP tool's twin)", "documents"
        ),
        search(
            "search",
            service.search_request,
            to_chunks,
            "Top chunks for a query, with filters, a threshold, this request's fusion and reranking, explained",
            "ranked chunks (each with its explanation when asked)",
        ),
        Op(
            "POST /facets",
            facets,
            "Exact counts of a metadata key's values among the chunks the filters (and a query) match",
            "each value with its count, most held first",
            (*BODY, *BUSY),
            reply=FacetResponse,
            body=FacetRequest,
        ),
        Op(
            "POST /documents",
            post_document,
            "Add a document (201) or replace it whole (200)",
            {200: "replaced", 201: "created"},
            (*BODY, ReadOnly, Overloaded, StorageFull),
            refresh,
            body=DocumentIn,
        ),
        Op(f"GET {docs}", get_document, "A document with its chunks", "the document", (DocumentNotFound,)),
        Op(
            f"DELETE {docs}",
            delete_document,
            "Delete a document and its chunks",
            "deleted",
            (DocumentNotFound, ReadOnly, BadRequest, StorageFull),
            refresh,
        ),
        Op(
            "POST /snapshots",
            take_snapshot,
            "Snapshot the index at its last acknowledged write (files that never change linked, each checksummed)",
            {201: "taken: its name, write position (seq), files, bytes and seconds"},
            (SnapshotRefused, Overloaded, StorageFull),
        ),
        Op("GET /snapshots", snapshots, "The snapshots in this server's folder, oldest first", "snapshots"),
        *(rerank(path) for path in RERANK_PATHS),
        Op(f"GET {SOLVER_PATH}", solver_card, "The solver's card: its input and rules", "card"),
        Op(
            f"POST {SOLVER_PATH}",
            solve,
            "Solve a benchmark task under a policy",
            "answers with policy metadata",
            (*BODY, GenerationFailed, *BUSY),
            body=SolverRequest,
        ),
        *door.operations(),
        Op("GET /health", health, "Liveness and what is loaded", "health"),
        Op("GET /metrics", metrics, "Prometheus metrics", "metrics", reply="text/plain"),
    ]
    spec = openapi_document(table, service.settings.security.key_all_doors, keyed_protocol=bool(door.keys))

    async def openapi(request: Request) -> Response:  # not in the document it serves
        return JSONResponse(spec)

    return [*(op.to_route() for op in table), Route("/openapi.json", openapi, methods=["GET"])]


def _waits(request: Request) -> bool:
    """``?refresh=wait_for`` (as Elasticsearch spells it): answer once the change is searchable."""
    unknown = sorted(set(request.query_params) - {"refresh"})
    if unknown:
        raise BadRequest(f"unknown query parameter {unknown[0]!r}; this route takes only 'refresh'")
    refresh = request.query_params.get("refresh", "false")
    if refresh not in REFRESH:
        raise BadRequest(f"refresh must be one of {', '.join(REFRESH)}, got {refresh!r}")
    return refresh in ("wait_for", "true")
