"""The System coordinator: one RAG turn as four messages under one correlated trace."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints

from agents.messages import Message, Turn
from agents.router import Router
from agents.settings import AgentSettings
from agents.traces import TraceStore
from engine.documents import Query, SearchFilters, TopK

SYSTEM_ID = "System"


class RagRequest(BaseModel):
    """One RAG turn as ``POST /v1/rag`` takes it."""

    question: Query = Field(description="the user's question")
    top_k: TopK = Field(5, description="chunks to retrieve as context")
    conversation_id: Annotated[str, StringConstraints(max_length=200)] | None = Field(
        None, description="continue this conversation (its messages share this id); default: a new one"
    )
    conversation_history: list[Turn] = Field(default_factory=list, description="earlier turns, oldest first")
    filters: SearchFilters | None = None


async def rag_turn(router: Router, request: RagRequest) -> dict:
    """RETRIEVAL_REQUEST → RETRIEVAL_RESULT → RESPONSE_REQUEST → RESPONSE_RESULT; returns every
    message of the turn (or the error that stopped it) and the trace ids they share."""
    question, history = request.question, [turn.model_dump() for turn in request.conversation_history]
    conversation = request.conversation_id or await router.traces.new_trace_id("RAG")
    meta = {"conversation_id": conversation}
    retrieval_request = {"query": question, "top_k": request.top_k}
    if request.filters is not None:
        retrieval_request["filters"] = request.filters.model_dump(mode="json", exclude_none=True)
    retrieval = Message(
        type="RETRIEVAL_REQUEST", sender=SYSTEM_ID, receiver="RetrievalAgent", payload=retrieval_request, metadata=meta
    )
    found = await router.send(retrieval)
    messages = [retrieval, found]
    if found.type != "ERROR_MESSAGE":
        context = [
            {"content": c["content"], "source": c["source_document"], "similarity_score": c["similarity_score"]}
            for c in found.payload["retrieved_chunks"]
        ]
        ask = Message(
            type="RESPONSE_REQUEST",
            sender=SYSTEM_ID,
            receiver="LLMResponseAgent",
            metadata=meta,
            payload={"user_query": question, "context_chunks": context, "conversation_history": history},
        )
        messages += [ask, await router.send(ask)]
    return {"conversation_id": conversation, "messages": [m.model_dump(mode="json") for m in messages]}


def build_responder(engine, settings: AgentSettings, timeout_s: float = 30.0):
    """The answer step every agent shares: extractive on the engine's own encoder, or an
    OpenAI-compatible server when ``llm_url`` is set (falling back to extractive unless told not to)."""
    from agents.chat_responder import ChatResponder
    from agents.responder import ExtractiveResponder

    s = settings
    responder = ExtractiveResponder(engine.dense.encoder, engine.dense.query_encoder)
    if s.llm_url:
        return ChatResponder(s.llm_url, s.llm_model, s.llm_api_key, responder, timeout_s, s.llm_fallback)
    return responder


def build_router(engine, traces: TraceStore, responder, timeout_s: float = 30.0, search=None) -> Router:
    """A router with the agents an engine can back: retrieval (and ingestion when the engine is
    writable) and the response agent on ``responder``; ``search``: the retrieval agent's
    :data:`~agents.retrieval_agent.SearchPort` (default: the engine on a thread)."""
    from agents.response_agent import LLMResponseAgent
    from agents.retrieval_agent import RetrievalAgent

    router = Router(traces, timeout_s=timeout_s)
    router.register(RetrievalAgent(engine, search))
    router.register(LLMResponseAgent(responder))
    return router
