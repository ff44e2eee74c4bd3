"""What the index holds and what a search may ask: documents made of chunks, filters, requests.

A chunk is the unit every retriever ranks. A BEIR record is one document of one chunk whose
chunk id is the document id, so its unit id (what results call ``doc_id``) stays the record's
``_id``; any other chunk is ``<document_id>#<chunk_id>``. The shapes are the DOCUMENT_INGESTION
payload of the agent message protocol.
"""

from __future__ import annotations

import functools
import json
import math
from datetime import date, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    create_model,
    field_validator,
    model_validator,
)

Scalar = str | int | float | bool
INT64 = range(-(2**63), 2**63)  # the integers SQLite holds (an equality filter's values are kept there)
# a character Python's str.strip() keeps: JSON Schema's \s lacks the separators \x1c-\x1f it strips
NON_BLANK = r"[^\s\x1c-\x1f]"
Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=512, pattern=NON_BLANK)]
# reserved document metadata with a meaning of their own (filters read them)
DOCUMENT_TYPE, DATE = "document_type", "date"
MAX_TOP_K = 100
# the widest a request may set a stage (a server's settings may pin a control, never widen these)
MAX_DEPTH, MAX_RERANK_DEPTH, MAX_WEIGHT, MAX_RRF_K = 1000, 200, 100.0, 1000.0
MAX_GROUP_SIZE = 10  # a grouped hit's chunks at most
MAX_HIGHLIGHTS, MAX_NEIGHBORS = 10, 5  # a hit's sentences, and its chunks on each side, at most
MAX_QUERY_CHARS = 4000  # Settings.max_query_chars' default: what the agent protocol and the solver take


def _stripped(text: str) -> str:
    if not text.strip():
        raise ValueError("must hold a non-blank character")
    return text.strip()


def _whole(value: object) -> object:
    """JSON's ``5.0`` is the integer 5 (JSON Schema agrees); ``true`` stays a boolean and is refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def query_text(max_chars: int = MAX_QUERY_CHARS) -> Any:
    """A question: at most ``max_chars`` as sent, not blank, answered stripped."""
    limits = Field(min_length=1, max_length=max_chars, json_schema_extra={"pattern": NON_BLANK})
    return Annotated[str, limits, AfterValidator(_stripped)]


Query = query_text()
TopK = Annotated[int, Field(ge=1, le=MAX_TOP_K, strict=True), BeforeValidator(_whole)]
Threshold = Annotated[float, Field(ge=0, le=1, strict=True)]
Depth = Annotated[int, Field(ge=1, le=MAX_DEPTH, strict=True), BeforeValidator(_whole)]
RerankDepth = Annotated[int, Field(ge=1, le=MAX_RERANK_DEPTH, strict=True), BeforeValidator(_whole)]
Weight = Annotated[float, Field(ge=0, le=MAX_WEIGHT, strict=True)]
# a retriever's name as the engine registers it (bm25, dense, memory, ...); which exist is the index's to say
RETRIEVER_NAME = r"^[a-z][a-z0-9_]{0,63}$"
RetrieverName = Annotated[str, StringConstraints(pattern=RETRIEVER_NAME)]


def problems(exc: ValidationError, whole: str = "body") -> str:
    """A validation error as one line naming each field (``whole`` when it is the value itself):
    what a 422, a CLI error or an INVALID_MESSAGE says."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or whole}: {e['msg']}" for e in exc.errors())


def kept_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """A document's metadata as the store keeps it: any JSON, so that a BEIR record builds as
    published and moves to the live API unchanged (:func:`filter_values` says which values filters
    read), with a ``date`` that is an ISO date written YYYY-MM-DD. A ValueError names a key holding
    NaN or Infinity (:func:`json_metadata`)."""
    if (day := iso_day(json_metadata(metadata).get(DATE))) is not None:
        metadata[DATE] = day
    return metadata


def json_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata`` when SQLite can keep it as JSON; a ValueError names a key holding NaN or
    Infinity, which Python reads in a JSON file but JSON has no way to write."""
    for key, value in metadata.items():
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            raise ValueError(f"metadata.{key} holds NaN or Infinity, which are not JSON") from None
    return metadata


def iso_day(value: object) -> str | None:
    """``value`` as the YYYY-MM-DD that ``date_range`` reads: an ISO date or the day of an ISO
    datetime; None for anything else (kept as sent, matched by no ``date_range``)."""
    try:
        return date.fromisoformat(value[:10]).isoformat() if isinstance(value, str) else None
    except ValueError:
        return None


def reserved_fields(metadata: dict[str, Any]) -> dict[str, str]:
    """What ``document_types`` and ``date_range`` read of a document's metadata: a string
    ``document_type`` and a ``date`` kept as an ISO date; another value under either key is kept
    and matched by neither."""
    kind, day = metadata.get(DOCUMENT_TYPE), metadata.get(DATE)
    found = {DOCUMENT_TYPE: kind} if isinstance(kind, str) else {}
    return found | ({DATE: day} if isinstance(day, str) and iso_day(day) == day else {})


def filter_values(value: object) -> list[Scalar] | None:
    """What an equality filter on a key holding ``value`` matches: a string, number or boolean
    itself, or each one a list holds (membership; its nulls skipped); nothing for null. None: a
    value filters cannot read (an object, a list holding one or a list, an integer past 64 bits),
    kept, and refused by name when a filter asks for its key."""
    if value is None:
        return []
    values = [v for v in value if v is not None] if isinstance(value, list) else [value]
    return values if all(map(filterable, values)) else None


def filterable(value: object) -> bool:
    """A value an equality filter can compare: a string, boolean, finite number, integer within 64 bits."""
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, str | bool) or (isinstance(value, int) and value in INT64)


def unit_id(document_id: str, chunk_id: str) -> str:
    """The id a retriever ranks: the document id for a one-chunk BEIR record, else both ids."""
    return document_id if chunk_id == document_id else f"{document_id}#{chunk_id}"


class ChunkIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunk_id: Name
    content: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
    metadata: dict[str, JsonValue] = Field(default_factory=dict)

    @field_validator("metadata")
    @classmethod
    def _json(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        return json_metadata(metadata)


class DocumentIn(BaseModel):
    """One document with all its chunks: applied whole, replacing any earlier version."""

    model_config = ConfigDict(extra="forbid")

    document_id: Name
    document_name: Annotated[str, StringConstraints(strip_whitespace=True, max_length=1024)] = ""
    chunks: list[ChunkIn] = Field(min_length=1)
    metadata: dict[str, JsonValue] = Field(default_factory=dict)
    embedding_model: str | None = None
    total_chunks: int | None = Field(None, ge=1)

    @field_validator("metadata")
    @classmethod
    def _kept(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        return kept_metadata(metadata)

    @model_validator(mode="after")
    def _whole(self) -> DocumentIn:
        seen: set[str] = set()
        for chunk in self.chunks:
            if chunk.chunk_id in seen:
                raise ValueError(f"chunk_id {chunk.chunk_id!r} appears twice in document {self.document_id!r}")
            seen.add(chunk.chunk_id)
        if self.total_chunks is not None and self.total_chunks != len(self.chunks):
            raise ValueError(f"total_chunks is {self.total_chunks} but {len(self.chunks)} chunks were sent")
        return self


class Filters(BaseModel):
    """Narrow a search; every given condition must hold. Any key besides the three named ones is
    equality on that metadata key (a chunk's own metadata first, then its document's): its value,
    or one of its list's (:func:`filter_values`)."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "additionalProperties": {"type": ["string", "number", "boolean"]},
            "propertyNames": {"pattern": NON_BLANK},
        },
    )

    document_types: list[Name] | None = Field(None, min_length=1)
    date_range: tuple[date | None, date | None] | None = None
    document_ids: list[Name] | None = Field(None, min_length=1)

    @field_validator("date_range", mode="before")
    @classmethod
    def _dates(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, list | tuple) or len(value) != 2:
            raise ValueError("date_range must be [from, to] (ISO dates; null leaves an end open)")
        return tuple(None if v is None else _iso_date(v, "date_range") for v in value)

    @model_validator(mode="after")
    def _equalities(self) -> Filters:
        for key, value in (self.model_extra or {}).items():
            if not filterable(value) or not key.strip():
                raise ValueError(
                    f"filter {key!r} must be a non-blank metadata key equal to a string, number or boolean"
                )
        return self

    @property
    def equalities(self) -> dict[str, Scalar]:
        return {k: v for k, v in (self.model_extra or {}).items() if not isinstance(v, Condition)}

    @property
    def conditions(self) -> dict[str, Condition]:
        """Operators by metadata key (:class:`SearchFilters`; none here)."""
        return {k: v for k, v in (self.model_extra or {}).items() if isinstance(v, Condition)}

    @property
    def all_of(self) -> list[Filters]:
        return []

    @property
    def any_of(self) -> list[Filters]:
        return []

    @property
    def none_of(self) -> Filters | None:
        return None

    @property
    def plain(self) -> bool:
        """Whether only the three named conditions are set (what Lucene's own terms can answer)."""
        return not (self.model_extra or self.all_of or self.any_of or self.none_of is not None)

    def keys(self) -> set[str]:
        """Every metadata key a condition anywhere in these filters reads."""
        nested = [*self.all_of, *self.any_of, *([self.none_of] if self.none_of is not None else [])]
        return set(self.model_extra or {}).union(*(f.keys() for f in nested))

    @property
    def empty(self) -> bool:
        return not (self.document_types or self.date_range or self.document_ids or not self.plain)


def _bound(value: object) -> object:
    """A range's end: a finite number, or an ISO date or datetime (compared as ISO strings)."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError("a range's bound is a number or an ISO date")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("a range's bound must be finite")
    if isinstance(value, str):  # written as the store keeps dates, so that strings compare in time order
        try:
            return date.fromisoformat(value).isoformat()
        except ValueError:
            pass
        try:
            return datetime.fromisoformat(value.upper()).isoformat()  # RFC 3339 allows a lower-case t and z
        except ValueError:
            raise ValueError(f"{value!r} is neither a number nor an ISO date (YYYY-MM-DD)") from None
    return _whole(value)


# what the schema promises is what _bound takes: a number, an ISO date or an RFC 3339 date-time
BOUND_SCHEMA = {
    "anyOf": [{"type": "number"}, {"type": "string", "format": "date"}, {"type": "string", "format": "date-time"}]
}
Bound = Annotated[int | float | str, BeforeValidator(_bound), WithJsonSchema(BOUND_SCHEMA)]


class Condition(BaseModel):
    """Operators on one metadata key, all of which must hold: ``eq``, ``in``, ``not_in`` (a list's
    members count one by one, as for equality), a range ``gt``/``gte``/``lt``/``lte`` on numbers or on
    ISO dates (one value meeting every bound), ``exists`` (a non-null value)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)

    eq: Scalar | None = None
    in_: list[Scalar] | None = Field(None, alias="in", min_length=1, max_length=1000)
    not_in: list[Scalar] | None = Field(None, min_length=1, max_length=1000)
    gt: Bound | None = None
    gte: Bound | None = None
    lt: Bound | None = None
    lte: Bound | None = None
    exists: Annotated[bool, Field(strict=True)] | None = None

    @model_validator(mode="after")
    def _coherent(self) -> Condition:
        values = [self.eq, *(self.in_ or ()), *(self.not_in or ())]
        if not all(filterable(v) for v in values if v is not None):
            raise ValueError("eq, in and not_in take strings, finite numbers and booleans")
        if all(v is None for v in self.model_dump().values()):
            raise ValueError("name at least one of eq, in, not_in, gt, gte, lt, lte, exists")
        if len({isinstance(b, str) for b in self.bounds.values()}) > 1:
            raise ValueError("a range's bounds are all numbers or all ISO dates")
        return self

    @property
    def bounds(self) -> dict[str, int | float | str]:
        """The range's operators that are set (gt, gte, lt, lte) and their bounds."""
        return {op: b for op in ("gt", "gte", "lt", "lte") if (b := getattr(self, op)) is not None}


MAX_FILTER_NESTING = 8  # "and", "or" and "not" within each other at most this deep


def _operator_schema(schema: dict[str, Any]) -> None:
    scalar = {"type": ["string", "number", "boolean"]}
    schema["additionalProperties"] = {"anyOf": [scalar, Condition.model_json_schema(by_alias=True)]}
    schema["propertyNames"] = {"pattern": NON_BLANK}


class SearchFilters(Filters):
    """:class:`Filters` with operators and logic, what a :class:`SearchRequest` takes: any other key
    holds a value (equality) or a :class:`Condition`, e.g. ``{"year": {"gte": 2020}}``, and ``and``,
    ``or`` and ``not`` combine whole filters, e.g. ``{"or": [{"source": "x"}, {"not": {"year": {"lt":
    2000}}}]}`` (so those three name no metadata key here). ``search_nfcorpus`` keeps :class:`Filters`."""

    model_config = ConfigDict(
        extra="allow", populate_by_name=True, serialize_by_alias=True, json_schema_extra=_operator_schema
    )

    and_: list[SearchFilters] | None = Field(None, alias="and", min_length=1, max_length=100)
    or_: list[SearchFilters] | None = Field(None, alias="or", min_length=1, max_length=100)
    not_: SearchFilters | None = Field(None, alias="not")

    @model_validator(mode="after")
    def _equalities(self) -> SearchFilters:
        extra = self.model_extra or {}
        for key, value in extra.items():
            if not key.strip():
                raise ValueError("a filter's metadata key must not be blank")
            if isinstance(value, dict | Condition):  # a Condition: validated once already
                try:
                    extra[key] = Condition.model_validate(value)
                except ValidationError as exc:
                    raise ValueError(f"filter {key!r}: {problems(exc, 'condition')}") from None
            elif not filterable(value):
                raise ValueError(f"filter {key!r} must equal a string, number or boolean, or hold operators")
        if self.nesting > MAX_FILTER_NESTING:
            raise ValueError(f"and, or and not nest at most {MAX_FILTER_NESTING} deep")
        return self

    @property
    def all_of(self) -> list[Filters]:
        return list(self.and_ or [])

    @property
    def any_of(self) -> list[Filters]:
        return list(self.or_ or [])

    @property
    def none_of(self) -> Filters | None:
        return self.not_

    @property
    def nesting(self) -> int:
        inner = [*(self.and_ or []), *(self.or_ or []), *([self.not_] if self.not_ else [])]
        return 1 + max((f.nesting for f in inner), default=0) if inner else 0


def _iso_date(value: Any, field: str) -> date:
    if isinstance(value, date):
        return value
    if (day := iso_day(value)) is None:
        raise ValueError(f"{field}: {value!r} is not an ISO date (YYYY-MM-DD)")
    return date.fromisoformat(day)


# The one statement of what a search may ask: every door validates with it, and the OpenAPI
# document, the MCP tools' arguments and the CLI's checks are read from it. Unknown keys are
# ignored (the agent protocol's RETRIEVAL_REQUEST forbids them).
SEARCH_TOOL = "search_nfcorpus"  # the benchmark's name for a search: the MCP tool, the REST path, the A2A client's call


class QueryRequest(BaseModel):
    """A search: the question, how many results, and optionally filters and a similarity threshold
    (what the benchmark's ``search_nfcorpus`` takes, and nothing more)."""

    query: Query = Field(description="the question")
    top_k: TopK = Field(5, description="how many results to return")
    filters: Filters | None = Field(None, description='e.g. {"document_types": ["guideline"]}')
    similarity_threshold: Threshold | None = Field(
        None, description="drop results whose similarity_score is below this (0-1)"
    )

    @classmethod
    def limited(cls, max_chars: int) -> type[QueryRequest]:
        """This model with queries of at most ``max_chars`` (the ``max_query_chars`` setting)."""
        return _limited(cls, max_chars)


class FusionControls(BaseModel):
    """How this request's candidates are fused, in place of the server's settings (unset: as served)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["rrf", "learned"] | None = Field(
        None, description="rrf: reciprocal rank fusion alone; learned: the index's trained fusion over RRF's candidates"
    )
    k: Annotated[float, Field(gt=0, le=MAX_RRF_K, strict=True)] | None = Field(None, description="RRF's constant k")
    weights: dict[RetrieverName, Weight] | None = Field(
        None,
        description='each retriever\'s weight in RRF, e.g. {"bm25": 1, "dense": 0.5, "memory": 0}; 0 leaves its'
        " candidates out; a retriever not named keeps the server's weight",
    )


class RerankControls(BaseModel):
    """Whether and how deep the cross-encoder reranks this request's fused candidates."""

    model_config = ConfigDict(extra="forbid")

    enabled: Annotated[bool, Field(strict=True)] | None = Field(None, description="false: serve the fused order")
    depth: RerankDepth | None = Field(None, description="fused candidates the reranker rescores")


class RetrieverControls(BaseModel):
    """One first-stage retriever's part in this request."""

    model_config = ConfigDict(extra="forbid")

    depth: Depth | None = Field(None, description="candidates this retriever hands to fusion")


class HighlightControls(BaseModel):
    """Each hit's best sentences, with their offsets in its text."""

    model_config = ConfigDict(extra="forbid")

    sentences: Annotated[int, Field(ge=1, le=MAX_HIGHLIGHTS, strict=True), BeforeValidator(_whole)] = Field(
        2, description="sentences a hit shows, best first"
    )


class ContextControls(BaseModel):
    """The chunks around each hit in its document and section."""

    model_config = ConfigDict(extra="forbid")

    neighbors: Annotated[int, Field(ge=1, le=MAX_NEIGHBORS, strict=True), BeforeValidator(_whole)] = Field(
        1, description="chunks before and after a hit"
    )


class SearchRequest(QueryRequest):
    """A search with, optionally, an explanation of each hit and this request's own fusion,
    reranking and retriever depths, within the limits the server sets."""

    filters: SearchFilters | None = Field(
        None,
        description='e.g. {"and": [{"year": {"gte": 2020}}, {"document_type": {"in": ["review", "guideline"]}},'
        ' {"not": {"source": "x"}}]}; operators: eq, in, not_in, gt, gte, lt, lte (numbers, ISO dates), exists',
    )
    explain: Annotated[bool, Field(strict=True)] | Literal["full"] = Field(
        False,
        description="true: each hit carries every stage's rank and score and how its final place was formed; full:"
        " also each feature's share of a learned fusion's score (SHAP values: ~10 ms more a query on a CPU)",
    )
    fusion: FusionControls | None = Field(None, description='e.g. {"method": "rrf", "weights": {"bm25": 1}}')
    rerank: RerankControls | None = Field(None, description='e.g. {"enabled": false} or {"depth": 50}')
    retrievers: dict[RetrieverName, RetrieverControls] | None = Field(
        None, description='per retriever, e.g. {"dense": {"depth": 200}}'
    )

    group_by: Literal["document_id"] | None = Field(
        None, description="document_id: top_k distinct documents, each hit its best chunk with the next in its group"
    )
    group_size: Annotated[int, Field(ge=1, le=MAX_GROUP_SIZE, strict=True), BeforeValidator(_whole)] = Field(
        1, description="with group_by: the chunks a document shows, best first (the hit and its group)"
    )

    paginate: Annotated[bool, Field(strict=True)] = Field(
        False,
        description="the reply carries next_page_token while the ranking holds more: this ranking, pinned (pages"
        " concatenate to one longer list whatever is written meanwhile)",
    )
    page_token: Annotated[str, StringConstraints(min_length=1, max_length=2048)] | None = Field(
        None,
        description="the next_page_token of the reply before, with the same query, filters and controls (top_k may"
        " change): the next page of that reply's ranking; an expired one is a 410",
    )

    highlight: HighlightControls | None = Field(
        None, description='e.g. {"sentences": 2}: each hit\'s best sentences, with their offsets in its text'
    )
    context: ContextControls | None = Field(
        None, description='e.g. {"neighbors": 1}: each hit with the chunks before and after it in its section'
    )

    @field_validator("group_size")
    @classmethod
    def _grouped(cls, size: int, info: ValidationInfo) -> int:
        if size != 1 and info.data.get("group_by") is None:
            raise ValueError("group_size needs group_by")
        return size

    @property
    def controlled(self) -> bool:
        """Whether the request departs from the server's fusion, reranking or depths."""
        return any(v is not None for v in (self.fusion, self.rerank, self.retrievers))


class FacetRequest(BaseModel):
    """Exact counts of one metadata key's values among the chunks that match (POST /facets)."""

    model_config = ConfigDict(extra="forbid")

    key: Name = Field(description="the metadata key whose values are counted, e.g. document_type")
    filters: SearchFilters | None = Field(None, description="count only the chunks these filters allow")
    query: Query | None = Field(None, description="count only this query's candidates (every retriever's, fused)")
    count: Literal["chunks", "documents"] = Field("chunks", description="what each value's count counts")
    size: Annotated[int, Field(ge=1, le=1000, strict=True), BeforeValidator(_whole)] = Field(
        100, description="values answered at most, most held first"
    )


@functools.cache
def _limited(model: type[BaseModel], max_chars: int) -> type[BaseModel]:
    if max_chars == MAX_QUERY_CHARS:
        return model
    field = model.model_fields["query"]
    query = (query_text(max_chars), Field(description=field.description))
    return create_model(model.__name__, __base__=model, __module__=model.__module__, query=query)
