"""Answers grounded in retrieved text: extractive by default, an LLM server when one is configured.

No generative model exists on the machines this project is built on, so the default responder
composes its answer from the context itself, and says so: the context chunks are split into
sentences, each scored against the question with the index's own encoder (and, for a follow-up,
against the previous question too), and the best few, near-duplicates dropped, are joined with
``[n]`` citations to the sources they came from. Shared by the RAG response agent and the
benchmark solver.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from engine.retrieval.encoder import QueryEncoder, encode
from engine.text import split_sentences

FOLLOW_UP_WEIGHT = 0.5  # the previous question's share when a question leans on it
DUPLICATE_COSINE = 0.92
# Sentences are short and uneven; small batches pad less. On 2 CPU cores, 47 sentences of five
# abstracts encode in 0.76 s in batches of 8 against 1.72 s in one batch of 64.
SENTENCE_BATCH = 8


@dataclass
class Source:
    content: str
    source: str = ""
    relevance: float | None = None  # the retrieval's calibrated probability, when known


@dataclass
class Question:
    """What any responder is asked: the question, its context, the previous user question (for a
    follow-up) and the generation parameters (``model`` and ``temperature`` are a generator's; an
    extracted answer has neither)."""

    text: str
    context: list[Source]
    previous: str | None = None
    max_tokens: int = 256
    model: str | None = None
    temperature: float = 0.0


@dataclass
class Answer:
    text: str
    sources: list[str]
    sentences: list[str] = field(default_factory=list)
    confidence: float = 0.0
    tokens: int = 0
    seconds: float = 0.0
    backend: str = "extractive"


class ExtractiveResponder:
    """Best sentences of the context, with citations; ``encoder`` is the index's sentence encoder
    (the context's sentences, batched), ``query_encoder`` its query encoder (one question at a time,
    as a search encodes its query)."""

    def __init__(self, encoder, query_encoder: QueryEncoder, max_sentences: int = 3) -> None:
        self.encoder = encoder
        self.query_encoder = query_encoder
        self.max_sentences = max_sentences

    def tokens(self, *texts: str) -> int:
        """Real tokens of the encoder's tokenizer (what a reader model would be fed)."""
        tokenizer = self.encoder.tokenizer
        return sum(len(tokenizer(t, add_special_tokens=False, verbose=False)["input_ids"]) for t in texts if t)

    @staticmethod
    def confidence(cited: list[Source], cosines: list[float]) -> float:
        """The probability that the best source the answer cites is relevant, when the retrieval
        calibrated its sources (the RAG path); else the mean cosine of the chosen sentences."""
        known = [c.relevance for c in cited if c.relevance is not None]
        if known:
            return float(max(known))
        return float(np.clip(np.mean(cosines), 0.0, 1.0)) if cosines else 0.0

    def answer(self, question: Question) -> Answer:
        started = time.perf_counter()
        context, previous = question.context, question.previous
        pieces = [(i, s) for i, chunk in enumerate(context) for s in split_sentences(chunk.content)]
        if not pieces:
            return Answer("The context holds nothing to answer from.", [], seconds=time.perf_counter() - started)
        vectors = encode(self.encoder, [s for _, s in pieces], SENTENCE_BATCH)
        scores = vectors @ self.query_encoder(question.text)[0]
        if previous:
            scores = scores + FOLLOW_UP_WEIGHT * (vectors @ self.query_encoder(previous)[0])
            scores = scores / (1 + FOLLOW_UP_WEIGHT)
        chosen: list[int] = []
        budget = question.max_tokens
        for j in np.argsort(-scores, kind="stable"):
            if len(chosen) == self.max_sentences:
                break
            if any(float(vectors[j] @ vectors[k]) > DUPLICATE_COSINE for k in chosen):
                continue
            cost = self.tokens(pieces[j][1])
            if chosen and cost > budget:
                continue
            chosen.append(int(j))
            budget -= cost
        chosen.sort(key=lambda j: (pieces[j][0], j))  # in the order the context gives them
        sources: list[str] = []
        parts = []
        for j in chosen:
            origin = context[pieces[j][0]].source or f"context {pieces[j][0] + 1}"
            if origin not in sources:
                sources.append(origin)
            parts.append(f"{pieces[j][1]} [{sources.index(origin) + 1}]")
        text = " ".join(parts)
        confidence = self.confidence([context[pieces[j][0]] for j in chosen], [float(scores[j]) for j in chosen])
        read = [question.text, *(c.content for c in context)]
        return Answer(
            text=text,
            sources=sources,
            sentences=[pieces[j][1] for j in chosen],
            confidence=confidence,
            tokens=self.tokens(*read, text),
            seconds=time.perf_counter() - started,
        )
