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
from engine.store.docstore import Chunk

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


class HighlightResult(BaseModel):
    text: str = Field(description="a sentence of the hit's text: text == the hit's text[start:end]")
    start: int
    end: int
    score: float = Field(description="its cosine with the query by the index's bi-encoder")


class NeighborChunk(BaseModel):
    doc_id: str
    chunk_id: str
    title: str
    text: str
    metadata: dict


class ContextResult(BaseModel):
    before: list[NeighborChunk] = Field(description="the chunks before the hit in its section, in document order")
    after: list[NeighborChunk] = Field(description="the chunks after it, in document order")


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
    highlights: list[HighlightResult] | None = Field(
        None, exclude_if=lambda value: value is None, description='only with "highlight": its best sentences'
    )
    context: ContextResult | None = Field(
        None, exclude_if=lambda value: value is None, description='only with "context": the chunks around it'
    )
    group: "list[ChunkResult] | None" = Field(
        None,
        exclude_if=lambda value: value is None,
        description='only with "group_by": this hit\'s document\'s next best chunks, best first',
    )


class ChunkResponse(BaseModel):
    results: list[ChunkResult]
    missing_shards: list[int] | None = MISSING_SHARDS
    next_page_token: str | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description='only with "paginate": true (or a page_token) while the ranking holds more: send it back as'
        " page_token with the same query for the next page",
    )


class FacetValue(BaseModel):
    value: str | int | float | bool = Field(description="a value the key holds (a boolean is counted as 1 or 0)")
    count: int


class FacetResponse(BaseModel):
    key: str
    count: str = Field(description="what each count counts: chunks or documents")
    values: list[FacetValue] = Field(description="most held first")


def to_facets(key: str, count: str, counts: list[tuple[object, int]]) -> FacetResponse:
    return FacetResponse(key=key, count=count, values=[FacetValue(value=v, count=n) for v, n in counts])


def _missing(hits: list[Hit]) -> list[int] | None:
    return getattr(hits, "missing_shards", None) or None


def to_chunks(hits: list[Hit]) -> ChunkResponse:
    """``hits`` as chunks; of a grouped search (``group_by``), each with its ``group``."""
    grouped = getattr(hits, "grouped", False)
    return ChunkResponse(
        results=[_chunk(h, grouped) for h in hits],
        missing_shards=_missing(hits),
        next_page_token=getattr(hits, "next_page_token", None),
    )


def _chunk(h: Hit, grouped: bool) -> ChunkResult:
    return ChunkResult(
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
        highlights=None if h.highlights is None else [HighlightResult(**vars(found)) for found in h.highlights],
        context=None if h.context is None else ContextResult(before=_near(h.context[0]), after=_near(h.context[1])),
        group=[_chunk(member, False) for member in h.group] if grouped else None,
    )


def _near(chunks: list[Chunk]) -> list[NeighborChunk]:
    return [
        NeighborChunk(doc_id=c.unit_id, chunk_id=c.chunk_id, title=c.title, text=c.text, metadata=c.metadata)
        for c in chunks
    ]


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
