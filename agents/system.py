"""The System coordinator: one RAG turn as four messages under one correlated trace."""

from __future__ import annotations

from agents.messages import Message
from agents.router import Router
from agents.traces import TraceStore

SYSTEM_ID = "System"


async def rag_turn(
    router: Router,
    question: str,
    conversation_id: str | None = None,
    history: list[dict] | None = None,
    top_k: int = 5,
    filters: dict | None = None,
) -> dict:
    """RETRIEVAL_REQUEST → RETRIEVAL_RESULT → RESPONSE_REQUEST → RESPONSE_RESULT; returns every
    message of the turn (or the error that stopped it) and the trace ids they share."""
    conversation = conversation_id or router.traces.new_trace_id("RAG")
    meta = {"conversation_id": conversation}
    retrieval_request = {"query": question, "top_k": top_k, **({"filters": filters} if filters else {})}
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
            payload={"user_query": question, "context_chunks": context, "conversation_history": history or []},
        )
        messages += [ask, await router.send(ask)]
    return {"conversation_id": conversation, "messages": [m.model_dump(mode="json") for m in messages]}


def build_responder(engine, timeout_s: float = 30.0):
    """The answer step every agent shares: extractive on the engine's own encoder, or an
    OpenAI-compatible server when ``llm_url`` is set (falling back to extractive unless told not to)."""
    from agents.chat_responder import ChatResponder
    from agents.responder import ExtractiveResponder

    s = engine.settings
    responder = ExtractiveResponder(engine.dense.encoder)
    if s.llm_url:
        return ChatResponder(s.llm_url, s.llm_model, s.llm_api_key, responder, timeout_s, s.llm_fallback)
    return responder


def build_router(engine, traces: TraceStore, responder, timeout_s: float = 30.0) -> Router:
    """A router with the agents an engine can back: retrieval (and ingestion when the engine is
    writable) and the response agent on ``responder``."""
    from agents.response_agent import LLMResponseAgent
    from agents.retrieval_agent import RetrievalAgent

    router = Router(traces, timeout_s=timeout_s)
    router.register(RetrievalAgent(engine))
    router.register(LLMResponseAgent(responder))
    return router
