"""What a search gives back: every stage's ranking for one query, and the hits a door answers with."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from engine.fusion.learned import LearnedFusion
from engine.rerank.cross_encoder import Scorer
from engine.retrieval.protocol import Ranking
from engine.search.explain import Explanation
from engine.search.explain import explain as explain_hits
from engine.search.highlights import Highlight
from engine.store.docstore import Chunk


@dataclass
class Hit:
    """One ranked document with what every stage said about it (ranks from 1, None = not found)."""

    doc_id: str
    score: float
    title: str
    text: str
    fused_score: float
    similarity_score: float = 0.0
    document_id: str = ""
    chunk_id: str = ""
    source_document: str = ""
    metadata: dict = field(default_factory=dict)
    found: dict[str, tuple[int, float]] = field(default_factory=dict)  # by each retriever that found it: (rank, score)
    rerank_score: float | None = None
    explanation: Explanation | None = None  # only when the request asked for one
    group: list[Hit] = field(default_factory=list)  # grouped by document: its next best chunks, best first
    highlights: list[Highlight] | None = None  # asked for: its best sentences
    context: tuple[list[Chunk], list[Chunk]] | None = None  # asked for: the chunks before and after it


@dataclass(frozen=True)
class SearchOptions:
    """One call's departures from the engine as loaded, so that callers choosing between models
    (training, evaluation, latency sweeps) never change an engine other threads search with.

    ``reranker`` / ``fusion``: score or fuse with this model instead of the engine's (a checkpoint
    being chosen); ``rerank_depth``: fused candidates to rerank, 0 for none (default: the engine's).
    A request's controls (:meth:`HybridEngine.options_for`): ``method`` ``rrf`` fuses by RRF alone,
    ``learned`` with the engine's model; ``rrf_k``, and ``weights`` and ``depths`` by retriever, in
    place of the settings'; ``explain``: each hit carries its :class:`Explanation`; ``group_size``:
    the hits are documents, each with its best chunks; ``paginate``, ``page_token`` and
    ``fingerprint``: pages of one pinned ranking (:mod:`engine.search.pages`); ``whole_ranking``:
    every fused candidate is read, not only the head served (a filter's second pass always runs).
    """

    reranker: Scorer | None = None
    fusion: LearnedFusion | None = None
    rerank_depth: int | None = None
    method: Literal["rrf", "learned"] | None = None
    rrf_k: float | None = None
    weights: Mapping[str, float] = field(default_factory=dict)
    depths: Mapping[str, int] = field(default_factory=dict)
    explain: bool | Literal["full"] = False  # full: with a learned fusion's feature contributions
    group_size: int = 0  # >0: one hit per document, with its best ``group_size`` chunks
    paginate: bool = False  # pin the ranking and answer the next page's token
    page_token: str | None = None  # a page of a pinned ranking, not a new search
    fingerprint: str = ""  # the request a page token is bound to
    whole_ranking: bool = False  # the caller reads every fused candidate, not the head it serves (facets)
    highlight: int = 0  # >0: each hit's best sentences
    neighbors: int = 0  # >0: each hit's chunks before and after


AS_LOADED = SearchOptions()


@dataclass(frozen=True)
class Plan:
    """What one query ran with: the settings under its request's controls."""

    query: str
    depths: dict[str, int]  # candidates asked of each retriever
    weights: dict[str, float]  # each retriever's in RRF
    rrf_k: float
    method: Literal["rrf", "learned", "rrf + corpus graph"]
    blend: float  # the reranker's share of the head's order


@dataclass
class StageResult:
    """Every stage's ranking for one query, for evaluation and latency reports: ``retrieved``, each
    first-stage retriever's, by name in the registry's order (what the learned fusion reads).
    ``fused`` is the fusion used (``fusion``: the learned model, None for ``rrf``). ``chunks`` and
    ``cosines`` (query and chunk, without a calibrated fusion) cover the fused head, read in the same
    view of the index as the rankings, so that a write landing before the answer is built cannot
    take a row from it."""

    retrieved: dict[str, Ranking]
    rrf: Ranking
    fused: Ranking
    reranked: Ranking | None
    seconds: dict[str, float] = field(default_factory=dict)
    rerank_scores: dict[str, float] = field(default_factory=dict)
    query_vector: np.ndarray | None = None
    chunks: dict[str, Chunk] = field(default_factory=dict)
    fusion: LearnedFusion | None = None
    cosines: dict[str, float] = field(default_factory=dict)
    missing_shards: list[int] = field(default_factory=list)  # a sharded index's shards that did not answer
    plan: Plan | None = None

    @property
    def final(self) -> Ranking:
        """The order served: the reranked head when the reranker ran, else the fused order."""
        return self.reranked if self.reranked is not None else self.fused

    @property
    def ranked(self) -> Ranking:
        """Every candidate in the order served: :attr:`final`, then the fused ones it left out."""
        head = {d for d, _ in self.final}
        return self.final + [hit for hit in self.fused if hit[0] not in head]


class Hits(list[Hit]):
    """A search's answer, best first; ``missing_shards``: the shards of a sharded index that did not
    answer, so the hits lack their documents (empty: a whole answer); ``grouped``: one hit a
    document, its next chunks in its ``group``; ``more``: the ranking holds hits past these, the
    next page's ``next_page_token`` when the search pinned its ranking."""

    def __init__(self, hits: list[Hit], missing_shards: list[int], grouped: bool = False) -> None:
        super().__init__(hits)
        self.missing_shards = missing_shards
        self.grouped, self.more = grouped, False
        self.next_page_token: str | None = None


def make_hits(
    result: StageResult,
    ranking: Ranking,
    chunks: dict[str, Chunk],
    similarities: list[float],
    similarity_threshold: float | None = None,
    explain: bool | Literal["full"] = False,
) -> Hits:
    """``ranking`` (of ``result``'s) as hits, each with its chunk, its ``similarities`` entry and
    every retriever's rank and score (``explain``: its whole :class:`Explanation`, ``full`` with a
    learned fusion's feature contributions); those under ``similarity_threshold`` are left out."""
    found = {name: {d: (r, s) for r, (d, s) in enumerate(ranking, 1)} for name, ranking in result.retrieved.items()}
    fused = dict(result.fused)
    kept = [
        (doc_id, score, similarity)
        for (doc_id, score), similarity in zip(ranking, similarities, strict=True)
        if similarity_threshold is None or similarity >= similarity_threshold
    ]
    ids = [doc_id for doc_id, _, _ in kept]
    explained = explain_hits(result, ids, explain == "full") if explain else [None] * len(kept)
    hits = []
    for (doc_id, score, similarity), explanation in zip(kept, explained, strict=True):
        chunk = chunks[doc_id]
        hits.append(
            Hit(
                doc_id=doc_id,
                score=score,
                title=chunk.title,
                text=chunk.text,
                fused_score=fused[doc_id],
                similarity_score=similarity,
                document_id=chunk.document_id,
                chunk_id=chunk.chunk_id,
                source_document=chunk.source_document,
                metadata=chunk.metadata,
                found={name: ranks[doc_id] for name, ranks in found.items() if doc_id in ranks},
                rerank_score=result.rerank_scores.get(doc_id),
                explanation=explanation,
            )
        )
    return Hits(hits, result.missing_shards)
