"""RetrievalAgent: the hybrid engine behind RETRIEVAL_REQUEST, and its live index behind
DOCUMENT_INGESTION (acknowledged with INGESTION_ACK once the write is durable)."""

from __future__ import annotations

import asyncio
import time

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
from engine.errors import ServiceError
from engine.live.writer import NotYetSearchable
from engine.search import HybridEngine


class RetrievalAgent:
    agent_id = "RetrievalAgent"
    agent_type = "retrieval"

    def __init__(self, engine: HybridEngine) -> None:
        self.engine = engine
        self.message_types = {"RETRIEVAL_REQUEST"} | ({"DOCUMENT_INGESTION"} if engine.live is not None else set())
        self.capabilities = ["hybrid-search", "filters", "similarity-threshold"]
        if engine.live is not None:
            self.capabilities.append("live-ingestion")

    async def handle(self, message: Message, payload: BaseModel) -> tuple[str, BaseModel]:
        if isinstance(payload, RetrievalRequest):
            return "RETRIEVAL_RESULT", await asyncio.to_thread(self._search, payload)
        return "INGESTION_ACK", await asyncio.to_thread(self._ingest, payload, bool(message.metadata.get("wait")))

    def _search(self, request: RetrievalRequest) -> RetrievalResult:
        started = time.perf_counter()
        try:
            hits = self.engine.search(
                request.query, request.top_k, request.filters, request.similarity_threshold, door="protocol"
            )
        except ValueError as exc:
            raise AgentError(ErrorCode.INVALID_MESSAGE, str(exc)) from None
        except Exception as exc:  # which retriever failed decides the code: the Java side is Lucene's
            code = (
                ErrorCode.LEXICAL_SEARCH_FAILED
                if "java" in type(exc).__module__.lower()
                else ErrorCode.VECTOR_SEARCH_FAILED
            )
            raise AgentError(code, f"search failed: {type(exc).__name__}: {exc}") from None
        chunks = [
            RetrievedChunk(
                chunk_id=h.doc_id,
                content=h.text,
                similarity_score=h.similarity_score,
                source_document=h.source_document or h.document_id,
                metadata={**h.metadata, "document_id": h.document_id, "title": h.title},
            )
            for h in hits
        ]
        elapsed = (time.perf_counter() - started) * 1000
        return RetrievalResult(
            query=request.query,
            retrieved_chunks=chunks,
            total_results=len(chunks),
            search_duration_ms=round(elapsed, 2),
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
