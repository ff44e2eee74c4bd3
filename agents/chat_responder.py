"""Answers from an OpenAI-compatible chat-completions server (vLLM, llama.cpp server, Ollama).

Optional: used when ``--llm-url`` names a server. The model reads the numbered context and is
asked to answer from it alone with ``[n]`` citations; ``generation_params`` (model, max_tokens,
temperature) are passed through. If the server fails, the answer is the extractive one and says
so in its first words, so a caller never mistakes it for the model's.
"""

from __future__ import annotations

import time

from agents.responder import Answer, ExtractiveResponder, Question
from engine.errors import ServiceError
from engine.health import FailureCount

INSTRUCTIONS = (
    "Answer the question using only the numbered context. Cite every claim with its number in square"
    " brackets, like [1]. If the context does not answer the question, say so."
)


class GenerationFailed(ServiceError, RuntimeError):
    """The LLM server failed and the extractive fallback is switched off (a bad gateway: 502)."""

    status, jsonrpc_code = 502, -32002


class ChatResponder:
    def __init__(
        self,
        url: str,
        model: str,
        api_key: str | None,
        fallback: ExtractiveResponder,
        timeout_s: float = 30.0,
        allow_fallback: bool = True,
    ) -> None:
        from openai import OpenAI

        self.client = OpenAI(base_url=url, api_key=api_key or "unused", timeout=timeout_s, max_retries=0)
        self.model, self.fallback, self.allow_fallback = model, fallback, allow_fallback
        self.health = FailureCount()  # /health and /metrics show a failing server, not only the answers

    def answer(self, question: Question) -> Answer:
        from openai import OpenAIError

        started = time.perf_counter()
        context, model = question.context, question.model or self.model
        sources = list(dict.fromkeys(c.source or f"context {i + 1}" for i, c in enumerate(context)))
        numbered = "\n\n".join(
            f"[{sources.index(c.source or f'context {i + 1}') + 1}] {c.content}" for i, c in enumerate(context)
        )
        messages = [{"role": "system", "content": INSTRUCTIONS}]
        if question.previous:
            messages.append({"role": "user", "content": question.previous})
        messages.append({"role": "user", "content": f"Context:\n{numbered}\n\nQuestion: {question.text}"})
        try:
            reply = self.client.chat.completions.create(
                model=model, messages=messages, max_tokens=question.max_tokens, temperature=question.temperature
            )
            text = (reply.choices[0].message.content or "").strip()
        except (OpenAIError, IndexError) as exc:
            self.health.failed(exc)
            if not self.allow_fallback:
                raise GenerationFailed(f"LLM server failed: {type(exc).__name__}: {exc}") from None
            answer = self.fallback.answer(question)
            answer.text = f"(LLM server failed: {type(exc).__name__}; extractive answer) {answer.text}"
            answer.backend = "extractive-fallback"
            return answer
        self.health.ok()
        support = self.fallback.answer(question)
        usage = getattr(reply, "usage", None)
        return Answer(
            text=text,
            sources=sources,  # numbered as the model saw them, so [n] is sources[n - 1]
            confidence=support.confidence,
            tokens=usage.total_tokens if usage and usage.total_tokens else self.fallback.tokens(numbered, text),
            seconds=time.perf_counter() - started,
            backend=f"llm:{model}",
        )
