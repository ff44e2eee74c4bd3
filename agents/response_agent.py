"""LLMResponseAgent: RESPONSE_REQUEST in, RESPONSE_RESULT out, answered by the shared responder."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from agents.chat_responder import ChatResponder, GenerationFailed
from agents.messages import ErrorCode, Message, ResponseRequest, ResponseResult
from agents.responder import ExtractiveResponder, Question, Source
from agents.router import AgentError


class LLMResponseAgent:
    agent_id = "LLMResponseAgent"
    agent_type = "response"
    message_types = {"RESPONSE_REQUEST"}

    def __init__(self, responder: ExtractiveResponder | ChatResponder) -> None:
        self.responder = responder
        kind = "llm-answers" if isinstance(responder, ChatResponder) else "extractive-answers"
        self.capabilities = [kind, "citations", "follow-up-questions"]

    async def handle(self, message: Message, payload: BaseModel) -> tuple[str, BaseModel]:
        request: ResponseRequest = payload  # type: ignore[assignment]
        previous = next((t.content for t in reversed(request.conversation_history) if t.role == "user"), None)
        params = request.generation_params
        context = [Source(c.content, c.source, c.similarity_score) for c in request.context_chunks]
        question = Question(request.user_query, context, previous, params.max_tokens, params.model, params.temperature)
        try:
            answer = await asyncio.to_thread(self.responder.answer, question)
        except GenerationFailed as exc:
            raise AgentError(ErrorCode.GENERATION_FAILED, str(exc)) from None
        return "RESPONSE_RESULT", ResponseResult(
            response=answer.text,
            source_documents=answer.sources,
            confidence_score=answer.confidence,
            tokens_used=answer.tokens,
            generation_time_ms=round(answer.seconds * 1000, 2),
        )
