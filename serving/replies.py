"""What the search doors answer: the benchmark's documents, or chunks with their fields."""

from urllib.parse import quote

from pydantic import BaseModel, Field
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from engine.errors import ServiceError
from engine.search import Hit
from engine.search.explain import Explanation

DOCUMENT_URI = "document://{document_id}"  # the MCP resource template a hit's whole document is read at


def document_uri(document_id: str) -> str:
    """The resource URI of a document (its id percent-encoded, so any id makes one URI)."""
    return DOCUMENT_URI.format(document_id=quote(document_id, safe=""))


class SearchResult(BaseModel):
    doc_id: str = Field(description="corpus document id, e.g. MED-123")
    score: float = Field(description="final relevance score (fusion and reranker blended when reranking is on)")
    title: str
    text: str


MISSING_SHARDS = Field(
    None,
    description="only when shards of a sharded index did not answer (served with --shard-failure partial): their"
    " numbers; the results lack their documents",
)


class SearchResponse(BaseModel):
    results: list[SearchResult]
    missing_shards: list[int] | None = MISSING_SHARDS


class ChunkResult(SearchResult):
    doc_id: str = Field(description="the chunk's id in the index: the document id, or document_id#chunk_id")
    document_id: str
    chunk_id: str
    source_document: str = Field(description="the document's name")
    metadata: dict = Field(description="the document's metadata with the chunk's own on top (page, section, ...)")
    similarity_score: float = Field(
        description="probability that the hit is relevant (calibrated on training judgments; without them, the"
        " cosine of query and chunk): what similarity_threshold compares"
    )
    resource_uri: str = Field(description="the whole document with all its chunks: MCP resources/read of this URI")
    explanation: Explanation | None = Field(
        None,
        exclude_if=lambda value: value is None,  # absent, not null, unless asked for: replies stay as they were
        description='only with "explain": true: every stage\'s rank and score for this hit and how its place was'
        " formed",
    )


class ChunkResponse(BaseModel):
    results: list[ChunkResult]
    missing_shards: list[int] | None = MISSING_SHARDS


def _missing(hits: list[Hit]) -> list[int] | None:
    return getattr(hits, "missing_shards", None) or None


def to_chunks(hits: list[Hit]) -> ChunkResponse:
    return ChunkResponse(
        results=[
            ChunkResult(
                doc_id=h.doc_id,
                score=h.score,
                title=h.title,
                text=h.text,
                document_id=h.document_id,
                chunk_id=h.chunk_id,
                source_document=h.source_document,
                metadata=h.metadata,
                similarity_score=h.similarity_score,
                resource_uri=document_uri(h.document_id),
                explanation=h.explanation,
            )
            for h in hits
        ],
        missing_shards=_missing(hits),
    )


def to_response(hits: list[Hit]) -> SearchResponse:
    return SearchResponse(
        results=[SearchResult(doc_id=h.doc_id, score=h.score, title=h.title, text=h.text) for h in hits],
        missing_shards=_missing(hits),
    )


async def _json_http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return JSONResponse({"error": f"{exc.detail}: {request.method} {request.url.path}"}, exc.status_code, exc.headers)


async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
    return JSONResponse({"error": str(exc)}, exc.status, exc.headers)


def json_errors(app: Starlette) -> Starlette:
    """Every failure a route raises answers ``{"error": ...}`` as JSON with the status its kind
    carries; unknown routes and methods too."""
    app.add_exception_handler(HTTPException, _json_http_error)
    app.add_exception_handler(ServiceError, _service_error)
    return app
