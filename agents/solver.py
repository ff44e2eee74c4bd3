"""The benchmark solver: a structured task in, policy-checked answers grounded in the corpus out.

Order matters and is fixed: the caller's policy first (a violating task is not answered, and the
violations say why), then the history compressed, then retrieval with what the recent turns were
about (so a follow-up like "and for children?" is searched in context), the shared responder, and
the answer formatted as the task expects. Every answer carries the documents it came from.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from agents.chat_responder import ChatResponder
from agents.formatter import Format, format_answer, items_from_text
from agents.history import compress
from agents.messages import Turn
from agents.policy import PolicyDoc, evaluate
from agents.responder import ExtractiveResponder, Question, Source
from engine.documents import MAX_QUERY_CHARS, Query

AGENT_NAME = "hybrid-search purple agent"
VERSION = "0.2.0"


class SolverRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task_id: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]
    task: Query
    policy_doc: PolicyDoc = Field(default_factory=PolicyDoc)
    history: list[Turn] = Field(default_factory=list, max_length=500)
    expected_format: Format = "list"
    context: Annotated[str, StringConstraints(max_length=20000)] | None = None


class Solver:
    def __init__(
        self,
        engine,
        responder: ExtractiveResponder | ChatResponder,
        max_query_chars: int = MAX_QUERY_CHARS,
        keep_last: int = 4,
        top_k: int = 5,
    ):
        self.engine, self.responder, self.max_query_chars = engine, responder, max_query_chars
        self.keep_last, self.top_k = keep_last, top_k

    def describe(self) -> dict:
        backend = "llm" if isinstance(self.responder, ChatResponder) else "extractive"
        return {
            "agent": AGENT_NAME,
            "version": VERSION,
            "status": "ready",
            "capabilities": [
                "policy-rules",
                "history-compression",
                f"{backend}-answers",
                "citations",
                "formats:list,single,json",
            ],
        }

    def solve(self, request: SolverRequest) -> dict:
        verdict = evaluate(request.policy_doc, [request.task, request.context or ""])
        metadata = {
            "policy_compliant": verdict.compliant,
            "policy_violations": verdict.violations,
            "applied_rules": verdict.applied_rules,
            "memory_compressed": False,
            "memory_summary": None,
            "citations": [],
        }
        if not verdict.compliant:
            return {"task_id": request.task_id, "answers": [], "metadata": metadata}
        history = compress([t.model_dump() for t in request.history], self.engine.dense.encoder, self.keep_last)
        previous = next((t["content"] for t in reversed(history.turns) if t["role"] == "user"), None)
        query = f"{previous} {request.task}" if previous else request.task
        longest = self.max_query_chars  # the task whole, the history's end before it
        hits = self.engine.search(query[-longest:], self.top_k, door="solver")
        sources = [Source(h.text, h.document_id, h.similarity_score) for h in hits]
        if request.context:
            sources.append(Source(request.context, "context"))
        answer = self.responder.answer(Question(request.task, sources, previous))
        items = answer.sentences if answer.sentences else items_from_text(answer.text)
        citations = [s for s in answer.sources if s != "context"]
        metadata.update(
            memory_compressed=history.compressed,
            memory_summary=history.summary,
            citations=citations,
            answer_backend=answer.backend,
            confidence=answer.confidence,
        )
        answers = format_answer(items, request.expected_format, {"citations": citations})
        return {"task_id": request.task_id, "answers": answers, "metadata": metadata}
