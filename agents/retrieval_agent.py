"""RetrievalAgent: the hybrid engine behind RETRIEVAL_REQUEST, and its live index behind
DOCUMENT_INGESTION (acknowledged with INGESTION_ACK once the write is durable).

Searches go through a :data:`SearchPort`: in a server, the search service every door uses (its
time limit, counters and errors; the message was admitted at its door already); alone, the
engine on a thread (:func:`engine_port`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from pydantic import BaseModel

from agents.messages import (
    DocumentIngestion,
    ErrorCode,
    IngestionAck,
    Message,
    RetrievalRequest,
    RetrievalResult,
    RetrievedChunk,
)
from agents.router import AgentError
from engine.documents import SearchRequest
from engine.errors import ServiceError
from engine.live.writer import NotYetSearchable
from engine.search import Hit, HybridEngine
from engine.search.stages import RetrieverFailed
from engine.store.docstore import Chunk

SearchPort = Callable[[SearchRequest, str], Awaitable[list[Hit]]]  # (request, door) -> hits


def engine_port(engine: HybridEngine) -> SearchPort:
    """The engine itself as a search port, on a thread: for an agent outside a server."""

    async def search(request: SearchRequest, door: str) -> list[Hit]:
        options = engine.options_for(request)
        return await asyncio.to_thread(
            engine.search, request.query, request.top_k, request.filters, request.similarity_threshold, options, door
        )

    return search


class RetrievalAgent:
    agent_id = "RetrievalAgent"
    agent_type = "retrieval"

    def __init__(self, engine: HybridEngine, search: SearchPort | None = None) -> None:
        self.engine = engine
        self.search = search or engine_port(engine)
        self.message_types = {"RETRIEVAL_REQUEST"} | ({"DOCUMENT_INGESTION"} if engine.live is not None else set())
        self.capabilities = ["hybrid-search", "filters", "similarity-threshold"]
        if engine.live is not None:
            self.capabilities.append("live-ingestion")

    async def handle(self, message: Message, payload: BaseModel) -> tuple[str, BaseModel]:
        if isinstance(payload, RetrievalRequest):
            return "RETRIEVAL_RESULT", await self._search(payload)
        return "INGESTION_ACK", await asyncio.to_thread(self._ingest, payload, bool(message.metadata.get("wait")))

    async def _search(self, request: RetrievalRequest) -> RetrievalResult:
        started = time.perf_counter()
        try:
            hits = await self.search(request, "protocol")  # a RetrievalRequest is a SearchRequest
        except ValueError as exc:
            raise AgentError(ErrorCode.INVALID_MESSAGE, str(exc)) from None
        except TimeoutError as exc:  # the service's query time limit
            raise AgentError(ErrorCode.TIMEOUT, str(exc)) from None
        except RetrieverFailed as exc:  # which retriever failed decides the code
            code = ErrorCode.LEXICAL_SEARCH_FAILED if exc.retriever == "bm25" else ErrorCode.VECTOR_SEARCH_FAILED
            raise AgentError(code, f"search failed: {exc}") from None
        chunks = [
            RetrievedChunk(
                chunk_id=h.doc_id,
                content=h.text,
                similarity_score=h.similarity_score,
                source_document=h.source_document or h.document_id,
                metadata={**h.metadata, "document_id": h.document_id, "title": h.title},
                explanation=h.explanation,
                highlights=None if h.highlights is None else [vars(found) for found in h.highlights],
                context=None if h.context is None else dict(zip(("before", "after"), _texts(h.context), strict=True)),
            )
            for h in (chunk for hit in hits for chunk in (hit, *hit.group))  # grouped: a document's chunks together
        ]
        elapsed = (time.perf_counter() - started) * 1000
        return RetrievalResult(
            query=request.query,
            retrieved_chunks=chunks,
            total_results=len(chunks),
            search_duration_ms=round(elapsed, 2),
            next_page_token=getattr(hits, "next_page_token", None),
        )

    def _ingest(self, document: DocumentIngestion, wait: bool) -> IngestionAck:
        try:
            ack = self.engine.live.upsert(document, wait=wait)
        except OSError as exc:  # a full disk (StorageFull) among them: nothing was logged
            raise AgentError(ErrorCode.INGESTION_FAILED, f"could not log the document: {exc}") from None
        except NotYetSearchable as exc:  # logged and kept, but the wait for it to be searchable failed
            raise AgentError(ErrorCode.INGESTION_FAILED, str(exc)) from None
        except ServiceError as exc:  # 503: the index's writer, in another process, is restarting or busy
            if exc.status != 503:
                raise
            retry_after = (exc.headers or {}).get("Retry-After")
            raise AgentError(ErrorCode.OVERLOADED, str(exc), int(retry_after) if retry_after else None) from None
        return IngestionAck(
            document_id=ack["document_id"],
            chunks_indexed=ack["chunks"],
            replaced=ack["replaced"],
            encoder=ack["encoder"],
            embedding_model_sent=document.embedding_model,
            searchable_within_s=0.0 if wait else self.engine.settings.refresh_interval_s,
        )


def _texts(context: tuple[list[Chunk], list[Chunk]]) -> list[list[str]]:
    """A hit's neighbours before and after it, as their texts."""
    return [[chunk.text for chunk in side] for side in context]
