"""What the index holds and what a search may ask: documents made of chunks, filters, requests.

A chunk is the unit every retriever ranks. A BEIR record is one document of one chunk whose
chunk id is the document id, so its unit id (what results call ``doc_id``) stays the record's
``_id``; any other chunk is ``<document_id>#<chunk_id>``. The shapes are the DOCUMENT_INGESTION
payload of the agent message protocol.
"""

from __future__ import annotations

import functools
from datetime import date
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

Scalar = str | int | float | bool
# a character Python's str.strip() keeps: JSON Schema's \s lacks the separators \x1c-\x1f it strips
NON_BLANK = r"[^\s\x1c-\x1f]"
Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=512, pattern=NON_BLANK)]
# reserved document metadata with a meaning of their own (filters read them)
DOCUMENT_TYPE, DATE = "document_type", "date"
MAX_TOP_K = 100
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


def problems(exc: ValidationError, whole: str = "body") -> str:
    """A validation error as one line naming each field (``whole`` when it is the value itself):
    what a 422, a CLI error or an INVALID_MESSAGE says."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or whole}: {e['msg']}" for e in exc.errors())


def checked_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """A document's metadata as filters read it: flat scalars, ``date`` an ISO date (normalised),
    ``document_type`` a string; a ValueError names the first key that is not."""
    for key, value in metadata.items():
        if not isinstance(value, Scalar | None):
            raise ValueError(f"metadata.{key} must be a string, number, boolean or null")
    if metadata.get(DATE) is not None:
        metadata[DATE] = _iso_date(metadata[DATE], f"metadata.{DATE}").isoformat()
    if metadata.get(DOCUMENT_TYPE) is not None and not isinstance(metadata[DOCUMENT_TYPE], str):
        raise ValueError(f"metadata.{DOCUMENT_TYPE} must be a string")
    return metadata


def unit_id(document_id: str, chunk_id: str) -> str:
    """The id a retriever ranks: the document id for a one-chunk BEIR record, else both ids."""
    return document_id if chunk_id == document_id else f"{document_id}#{chunk_id}"


class ChunkIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    chunk_id: Name
    content: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
    metadata: dict[str, Scalar | None] = Field(default_factory=dict)


class DocumentIn(BaseModel):
    """One document with all its chunks: applied whole, replacing any earlier version."""

    model_config = ConfigDict(extra="forbid")

    document_id: Name
    document_name: Annotated[str, StringConstraints(strip_whitespace=True, max_length=1024)] = ""
    chunks: list[ChunkIn] = Field(min_length=1)
    metadata: dict[str, Scalar | None] = Field(default_factory=dict)
    embedding_model: str | None = None
    total_chunks: int | None = Field(None, ge=1)

    @field_validator("metadata")
    @classmethod
    def _reserved_keys(cls, metadata: dict[str, Any]) -> dict[str, Any]:
        return checked_metadata(metadata)

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
    equality on that metadata key (a chunk's own metadata first, then its document's)."""

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
            if not isinstance(value, Scalar) or not key.strip():
                raise ValueError(
                    f"filter {key!r} must be a non-blank metadata key equal to a string, number or boolean"
                )
        return self

    @property
    def equalities(self) -> dict[str, Scalar]:
        return dict(self.model_extra or {})

    @property
    def empty(self) -> bool:
        return not (self.document_types or self.date_range or self.document_ids or self.model_extra)


def _iso_date(value: Any, field: str) -> date:
    if isinstance(value, date):
        return value
    try:
        return date.fromisoformat(str(value)[:10]) if isinstance(value, str) else _fail(field, value)
    except ValueError:
        return _fail(field, value)


def _fail(field: str, value: Any) -> date:
    raise ValueError(f"{field}: {value!r} is not an ISO date (YYYY-MM-DD)")


# The one statement of what a search may ask: every door validates with it, and the OpenAPI
# document, the MCP tools' arguments and the CLI's checks are read from it. Unknown keys are
# ignored (the agent protocol's RETRIEVAL_REQUEST forbids them).
SEARCH_TOOL = "search_nfcorpus"  # the benchmark's name for a search: the MCP tool, the REST path, the A2A client's call


class SearchRequest(BaseModel):
    """A search: the question, how many results, and optionally filters and a similarity threshold."""

    query: Query = Field(description="the question")
    top_k: TopK = Field(5, description="how many results to return")
    filters: Filters | None = Field(None, description='e.g. {"document_types": ["guideline"]}')
    similarity_threshold: Threshold | None = Field(
        None, description="drop results whose similarity_score is below this (0-1)"
    )

    @classmethod
    def limited(cls, max_chars: int) -> type[SearchRequest]:
        """This model with queries of at most ``max_chars`` (the ``max_query_chars`` setting)."""
        return _limited(cls, max_chars)


@functools.cache
def _limited(model: type[BaseModel], max_chars: int) -> type[BaseModel]:
    if max_chars == MAX_QUERY_CHARS:
        return model
    field = model.model_fields["query"]
    query = (query_text(max_chars), Field(description=field.description))
    return create_model(model.__name__, __base__=model, __module__=model.__module__, query=query)
