"""What a search gives back: every stage's ranking for one query, and the hits a door answers with."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.fusion.learned import LearnedFusion
from engine.rerank.cross_encoder import Scorer
from engine.retrieval.protocol import Ranking
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
    bm25_rank: int | None = None
    bm25_score: float | None = None
    dense_rank: int | None = None
    dense_score: float | None = None
    memory_rank: int | None = None
    rerank_score: float | None = None


@dataclass(frozen=True)
class SearchOptions:
    """One call's departures from the engine as loaded, so that callers choosing between models
    (training, evaluation, latency sweeps) never change an engine other threads search with.

    ``reranker`` / ``fusion``: score or fuse with this model instead of the engine's (a checkpoint
    being chosen); ``rerank_depth``: fused candidates to rerank, 0 for none (default: the engine's).
    """

    reranker: Scorer | None = None
    fusion: LearnedFusion | None = None
    rerank_depth: int | None = None


AS_LOADED = SearchOptions()


@dataclass
class StageResult:
    """Every stage's ranking for one query, for evaluation and latency reports. ``fused`` is the
    fusion used (``fusion``: the learned model, None for ``rrf``). ``chunks`` and ``cosines`` (query
    and chunk, without a calibrated fusion) cover the fused head, read in the same view of the index
    as the rankings, so that a write landing before the answer is built cannot take a row from it."""

    bm25: Ranking
    dense: Ranking
    memory: Ranking
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

    @property
    def retrieved(self) -> dict[str, Ranking]:
        """What each first-stage retriever returned, as the learned fusion reads it."""
        return {"bm25": self.bm25, "dense": self.dense, "memory": self.memory}

    @property
    def final(self) -> Ranking:
        """The order served: the reranked head when the reranker ran, else the fused order."""
        return self.reranked if self.reranked is not None else self.fused


class Hits(list[Hit]):
    """A search's answer, best first; ``missing_shards``: the shards of a sharded index that did not
    answer, so the hits lack their documents (empty: a whole answer)."""

    def __init__(self, hits: list[Hit], missing_shards: list[int]) -> None:
        super().__init__(hits)
        self.missing_shards = missing_shards


def make_hits(
    result: StageResult,
    top_k: int,
    chunks: dict[str, Chunk],
    similarities: list[float],
    similarity_threshold: float | None = None,
) -> Hits:
    """The first ``top_k`` of ``result.final`` as hits, each with its chunk, its ``similarities``
    entry and every stage's rank; those under ``similarity_threshold`` are left out."""
    bm25 = {d: (r, sc) for r, (d, sc) in enumerate(result.bm25, start=1)}
    dense = {d: (r, sc) for r, (d, sc) in enumerate(result.dense, start=1)}
    memory = {d: r for r, (d, _) in enumerate(result.memory, start=1)}
    fused = dict(result.fused)
    hits = []
    for (doc_id, score), similarity in zip(result.final[:top_k], similarities, strict=True):
        if similarity_threshold is not None and similarity < similarity_threshold:
            continue
        chunk = chunks[doc_id]
        b_rank, b_score = bm25.get(doc_id, (None, None))
        d_rank, d_score = dense.get(doc_id, (None, None))
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
                bm25_rank=b_rank,
                bm25_score=b_score,
                dense_rank=d_rank,
                dense_score=d_score,
                memory_rank=memory.get(doc_id),
                rerank_score=result.rerank_scores.get(doc_id),
            )
        )
    return Hits(hits, result.missing_shards)
