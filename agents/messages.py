"""The agent message protocol: one envelope, typed payloads, a registry of types.

Not the Model Context Protocol: these are the messages agents of a RAG system pass each other
(ingestion, retrieval, response, errors). Every message is an envelope (``type``, ``sender``,
``receiver``, ``trace_id``, ``timestamp``, ``payload``, ``metadata``) whose payload is validated by
the model registered for its type. :func:`register_message_type` is the extension point; the
ingestion acknowledgement is registered through it like any custom type.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from engine.documents import DocumentIn, Query, SearchRequest
from engine.search.explain import Explanation

AgentId = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=128)]


class Message(BaseModel):
    """The envelope every message shares; ``payload`` is checked against its type's model."""

    model_config = ConfigDict(extra="forbid")

    type: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    sender: AgentId
    receiver: AgentId
    trace_id: Annotated[str, StringConstraints(max_length=200)] | None = None
    timestamp: datetime = Field(default_factory=lambda: datetime.now(UTC))
    payload: dict[str, Any]
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("timestamp")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


# ---------------------------------------------------------------- the six types


class DocumentIngestion(DocumentIn):
    """DOCUMENT_INGESTION: a whole document with its chunks (IngestionAgent → RetrievalAgent)."""

    embedding_model: str = Field(description="informational: the index embeds with its own encoder")
    total_chunks: int = Field(ge=1, description="must equal the chunks sent: a document arrives whole")


class RetrievalRequest(SearchRequest):
    """RETRIEVAL_REQUEST: a search as every door takes it, with no key the search does not read."""

    model_config = ConfigDict(extra="forbid")


class RetrievedChunk(BaseModel):
    chunk_id: str
    content: str
    similarity_score: float
    source_document: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    explanation: Explanation | None = Field(
        None, exclude_if=lambda value: value is None, description='only with "explain": true in the request'
    )
    highlights: list[dict[str, Any]] | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description='only with "highlight": its best sentences, {"text", "start", "end", "score"} (in content)',
    )
    context: dict[str, list[str]] | None = Field(
        None,
        exclude_if=lambda value: value is None,
        description='only with "context": the texts of the chunks "before" and "after" it in its section',
    )


class RetrievalResult(BaseModel):
    query: str
    retrieved_chunks: list[RetrievedChunk]
    total_results: int
    search_duration_ms: float
    next_page_token: str | None = Field(
        None, exclude_if=lambda value: value is None, description='only with "paginate": true while more remain'
    )


class ContextChunk(BaseModel):
    content: Annotated[str, StringConstraints(min_length=1)]
    source: str = ""
    similarity_score: float | None = Field(
        None, ge=0, le=1, description="optional: the retrieval's calibrated relevance, which confidence uses"
    )


class Turn(BaseModel):
    role: Annotated[str, StringConstraints(pattern="^(user|assistant|system)$")]
    content: str


class GenerationParams(BaseModel):
    model: str | None = None
    max_tokens: int = Field(256, ge=1, le=8192)
    temperature: float = Field(0.0, ge=0, le=2)


class ResponseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_query: Query
    context_chunks: list[ContextChunk] = Field(default_factory=list)
    conversation_history: list[Turn] = Field(default_factory=list)
    generation_params: GenerationParams = Field(default_factory=GenerationParams)


class ResponseResult(BaseModel):
    response: str
    source_documents: list[str]
    confidence_score: float = Field(ge=0, le=1)
    tokens_used: int = Field(ge=0)
    generation_time_ms: float


class ErrorCode(StrEnum):
    INVALID_MESSAGE = "INVALID_MESSAGE"
    UNKNOWN_MESSAGE_TYPE = "UNKNOWN_MESSAGE_TYPE"
    UNKNOWN_RECEIVER = "UNKNOWN_RECEIVER"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    RATE_LIMITED = "RATE_LIMITED"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    VECTOR_SEARCH_FAILED = "VECTOR_SEARCH_FAILED"
    LEXICAL_SEARCH_FAILED = "LEXICAL_SEARCH_FAILED"
    INGESTION_FAILED = "INGESTION_FAILED"
    GENERATION_FAILED = "GENERATION_FAILED"
    TIMEOUT = "TIMEOUT"
    OVERLOADED = "OVERLOADED"
    INTERNAL = "INTERNAL"


# (retry_possible, suggested_action): the documented table; the router reads it
ERRORS: dict[ErrorCode, tuple[bool, str]] = {
    ErrorCode.INVALID_MESSAGE: (False, "fix the fields named in error_message and send again"),
    ErrorCode.UNKNOWN_MESSAGE_TYPE: (False, "send a type the receiver lists in GET /v1/agents"),
    ErrorCode.UNKNOWN_RECEIVER: (False, "address an agent_id listed in GET /v1/agents"),
    ErrorCode.UNAUTHORIZED: (False, "send 'Authorization: Bearer <key>' with the sender's key"),
    ErrorCode.FORBIDDEN: (False, "send as the agent your key belongs to, a type that agent may send"),
    ErrorCode.RATE_LIMITED: (True, "wait for the Retry-After seconds, then send again"),
    ErrorCode.PAYLOAD_TOO_LARGE: (False, "split the document into smaller messages or chunks"),
    ErrorCode.VECTOR_SEARCH_FAILED: (True, "retry; if it persists, check /health (dense index)"),
    ErrorCode.LEXICAL_SEARCH_FAILED: (True, "retry; if it persists, check /health (Lucene index)"),
    ErrorCode.INGESTION_FAILED: (True, "retry the same message: ingestion is idempotent by document_id"),
    ErrorCode.GENERATION_FAILED: (True, "retry, or ask without generation_params.model for the extractive answer"),
    ErrorCode.TIMEOUT: (True, "retry later or with a smaller top_k / fewer context chunks"),
    ErrorCode.OVERLOADED: (True, "the server is at capacity: wait for the Retry-After seconds, then send again"),
    ErrorCode.INTERNAL: (False, "report it with the trace_id; the server log has the details"),
}


class OriginalRequest(BaseModel):
    type: str
    trace_id: str | None = None


class ErrorPayload(BaseModel):
    error_code: ErrorCode
    error_message: str
    original_request: OriginalRequest
    retry_possible: bool
    suggested_action: str


class IngestionAck(BaseModel):
    """INGESTION_ACK (a registered custom type): the document is durable and when it is searchable."""

    document_id: str
    chunks_indexed: int
    replaced: bool
    encoder: str = Field(description="the encoder that embedded the chunks (the index's own)")
    embedding_model_sent: str | None = None
    durable: bool = Field(True, description="in the write-ahead log, fsynced, before this answer")
    searchable_within_s: float = Field(description="0 when the sender asked to wait for visibility")


PAYLOADS: dict[str, type[BaseModel]] = {
    "DOCUMENT_INGESTION": DocumentIngestion,
    "RETRIEVAL_REQUEST": RetrievalRequest,
    "RETRIEVAL_RESULT": RetrievalResult,
    "RESPONSE_REQUEST": ResponseRequest,
    "RESPONSE_RESULT": ResponseResult,
    "ERROR_MESSAGE": ErrorPayload,
}


def register_message_type(name: str, payload: type[BaseModel]) -> None:
    """Add a message type (the protocol's extension point); its payload model validates it."""
    if not name.isupper() or not name.replace("_", "").isalnum():
        raise ValueError(f"message type {name!r}: use UPPER_SNAKE_CASE")
    if name in PAYLOADS and PAYLOADS[name] is not payload:
        raise ValueError(f"message type {name!r} is already registered")
    PAYLOADS[name] = payload


register_message_type("INGESTION_ACK", IngestionAck)


def schemas() -> dict[str, dict]:
    """JSON Schema of the envelope and of every registered payload."""
    return {"Message": Message.model_json_schema(), **{n: m.model_json_schema() for n, m in PAYLOADS.items()}}
