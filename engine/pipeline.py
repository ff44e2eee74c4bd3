"""The hybrid engine: BM25, dense and judgment-memory retrieval, fusion (RRF, or learned when the
index has a trained fusion model), reranking."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.batching import RerankBatcher
from engine.config import Settings
from engine.dense import DenseRetriever
from engine.fusion import blend_reranking, reciprocal_rank_fusion
from engine.index_dir import BM25_DIR, DENSE_FILE, FUSION_DIR, MEMORY_DIR, Manifest, read_docs, read_manifest
from engine.learned_fusion import FusionModelError, LearnedFusion
from engine.lucene import BM25Retriever
from engine.memory import JudgmentMemory
from engine.models import load_encoder, pick_device
from engine.rerank import Reranker, RerankerError

log = logging.getLogger(__name__)


@dataclass
class Hit:
    """One ranked document with what every stage said about it (ranks from 1, None = not found)."""

    doc_id: str
    score: float
    title: str
    text: str
    fused_score: float
    bm25_rank: int | None = None
    bm25_score: float | None = None
    dense_rank: int | None = None
    dense_score: float | None = None
    memory_rank: int | None = None
    rerank_score: float | None = None


@dataclass
class StageResult:
    """Every stage's ranking for one query, for evaluation and latency reports. ``fused`` is the
    fusion served (the learned one when loaded, else ``rrf``)."""

    bm25: list[tuple[str, float]]
    dense: list[tuple[str, float]]
    memory: list[tuple[str, float]]
    rrf: list[tuple[str, float]]
    fused: list[tuple[str, float]]
    reranked: list[tuple[str, float]] | None
    seconds: dict[str, float] = field(default_factory=dict)
    rerank_scores: dict[str, float] = field(default_factory=dict)
    query_vector: np.ndarray | None = None

    @property
    def retrieved(self) -> dict[str, list[tuple[str, float]]]:
        """What each first-stage retriever returned, as the learned fusion reads it."""
        return {"bm25": self.bm25, "dense": self.dense, "memory": self.memory}


class HybridEngine:
    """Loads an index directory once; ``search`` is thread-safe and deterministic."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        index_dir = Path(settings.index_dir)
        self.manifest: Manifest = read_manifest(index_dir)
        self.device = pick_device(settings.device)
        docs = read_docs(index_dir, self.manifest.documents)
        self.docs = {doc.doc_id: doc for doc in docs}
        self.bm25 = BM25Retriever(index_dir / BM25_DIR, settings.bm25_k1, settings.bm25_b)
        encoder = load_encoder(self.manifest.encoder, self.device)
        self.dense = DenseRetriever(
            index_dir / DENSE_FILE, [d.doc_id for d in docs], encoder, settings.hnsw_ef_search, self.device
        )
        self.memory = self._load_memory(index_dir)
        self.fusion = self._load_fusion(index_dir / FUSION_DIR)
        self.reranker = self._load_reranker()

    def _load_memory(self, index_dir: Path) -> JudgmentMemory | None:
        if not self.settings.memory or not (index_dir / MEMORY_DIR).is_dir():
            return None
        return JudgmentMemory(index_dir / MEMORY_DIR, self.settings.memory_neighbors)

    def _load_fusion(self, folder: Path) -> LearnedFusion | None:
        """``auto`` uses a trained fusion model when the index has one (a broken one is reported and
        RRF serves); ``learned`` requires one; ``rrf`` never loads one."""
        mode = self.settings.fusion
        if mode == "rrf" or (mode == "auto" and not folder.is_dir()):
            return None
        try:
            return LearnedFusion(folder)
        except FusionModelError as exc:
            if mode == "learned":
                raise
            log.warning("%s; serving RRF", exc)
            return None

    def _load_reranker(self) -> Reranker | RerankBatcher | None:
        if not self.settings.rerank:
            return None
        path = self.settings.reranker_path
        if self.settings.reranker is None and not Path(path).is_dir():
            log.warning(
                "no reranker at %s (train one with `hybrid-search train-reranker`); serving fused results", path
            )
            return None
        try:
            s = self.settings
            reranker = Reranker(path, self.device, s.max_length, s.rerank_batch_size, s.rerank_runtime)
        except RerankerError as exc:
            if self.settings.reranker is not None:
                raise
            log.warning("%s; serving fused results", exc)
            return None
        missing = self.missing_memory_context() if reranker.memory_context else None
        if missing:
            message = f"{path} reads each document after the training queries that cited it, and {missing}"
            if self.settings.reranker is not None:
                raise RerankerError(message)
            log.warning("%s; serving fused results", message)
            return None
        if self.device == "cuda" and self.settings.rerank_batch_wait_ms > 0:
            return RerankBatcher(reranker, self.settings.rerank_batch_wait_ms / 1000)
        return reranker

    def missing_memory_context(self) -> str | None:
        """Why this engine cannot give a memory-aware reranker its context, or None when it can."""
        if self.memory is None:
            return "this engine has no judgment memory"
        if self.memory.texts is None:
            return "this index's memory keeps no query texts (rebuild it with `hybrid-search build`)"
        return None

    def stages(self, query: str, top_k: int = 10, exclude: str | None = None) -> StageResult:
        """Run every stage; the reranker rescores the fused top ``max(rerank_depth, top_k)``.

        ``exclude`` names a training query to leave out of the judgment memory, so that training
        and mining see a training query's candidates as a new query would (without its own labels).
        """
        s = self.settings
        seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        bm25 = self.bm25.search(query, max(s.bm25_depth, top_k))
        t1 = time.perf_counter()
        vector = self.dense.encode_query(query)
        t_enc = time.perf_counter()
        dense = self.dense.search(vector, max(s.dense_depth, top_k))
        t_dense = time.perf_counter()
        memory = self.memory.search(vector, s.memory_depth, exclude=exclude) if self.memory else []
        t2 = time.perf_counter()
        rankings = {"bm25": [d for d, _ in bm25], "dense": [d for d, _ in dense], "memory": [d for d, _ in memory]}
        weights = {"bm25": s.bm25_weight, "dense": s.dense_weight, "memory": s.memory_weight}
        rrf = reciprocal_rank_fusion(rankings, k=s.rrf_k, weights=weights)
        found = {"bm25": bm25, "dense": dense, "memory": memory}
        fused = self.fusion.rank(query, found, rrf) if self.fusion is not None else rrf
        t3 = time.perf_counter()
        seconds.update(bm25=t1 - t0, encode=t_enc - t1, dense=t_dense - t_enc, memory=t2 - t_dense, fusion=t3 - t2)
        reranked, rerank_scores = None, {}
        if self.reranker is not None:
            reranked = self.rerank(query, fused, rerank_scores, top_k, vector, exclude)
            seconds["rerank"] = time.perf_counter() - t3
        seconds["total"] = time.perf_counter() - t0
        return StageResult(bm25, dense, memory, rrf, fused, reranked, seconds, rerank_scores, vector)

    def rerank(
        self,
        query: str,
        ranking: list[tuple[str, float]],
        scores: dict[str, float],
        top_k: int = 1,
        vector: np.ndarray | None = None,
        exclude: str | None = None,
    ) -> list[tuple[str, float]]:
        """The head of ``ranking`` (``max(rerank_depth, top_k)`` documents with their first-stage scores)
        reordered by the reranker, blended with the first stage (``rerank_blend``). ``scores`` caches
        cross-encoder scores: documents already in it are not scored again and new ones are added, so
        several rankings of one query share the work. ``vector`` (the query's embedding, encoded when
        not given) and ``exclude`` pick a memory-aware reranker's context, as for the memory's votes.
        """
        s = self.settings
        head = ranking[: max(s.rerank_depth_for(self.device), top_k)]
        todo = [d for d, _ in head if d not in scores]
        if todo:
            passages = self.rerank_passages(query, todo, self.reranker.memory_context, vector, exclude)
            scores.update(zip(todo, self.reranker.score(query, passages), strict=True))
        return blend_reranking(head, [scores[d] for d, _ in head], s.rerank_blend)

    def rerank_passages(
        self,
        query: str,
        doc_ids: list[str],
        context: int,
        vector: np.ndarray | None = None,
        exclude: str | None = None,
    ) -> list[str]:
        """What a reranker reads for each document: its text, after the ``context`` training queries
        nearest the query that cited it when the reranker was trained that way (``memory_context``
        in its model card; training builds its pairs here too)."""
        if not context:
            return [self.docs[d].contents for d in doc_ids]
        if vector is None:
            vector = self.dense.encode_query(query)
        cited = (self.memory.cited_for(vector, d, context, exclude) for d in doc_ids)
        return [f"{c} {self.docs[d].contents}" for c, d in zip(cited, doc_ids, strict=True)]

    def describe(self) -> dict:
        """How this engine fuses and reranks, defaults resolved: what health checks and run summaries
        report."""
        r, s = self.reranker, self.settings
        return {
            "fusion": f"learned ({self.fusion.describe()})" if self.fusion else "rrf",
            "reranker": r.name if r else None,
            "reranker_runtime": r.runtime if r else None,
            "rerank_depth": s.rerank_depth_for(self.device) if r else 0,
            "rerank_blend": s.rerank_blend if r else None,
            "rerank_max_length": r.max_length if r else None,
            "rerank_memory_context": r.memory_context if r else None,
        }

    def search(self, query: str, top_k: int = 5) -> list[Hit]:
        """Exactly ``top_k`` unique documents (fewer only if the corpus is smaller), best first."""
        if not query.strip():
            raise ValueError("query is empty")
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        result = self.stages(query, top_k)
        return self.hits(result, top_k)

    def hits(self, result: StageResult, top_k: int) -> list[Hit]:
        bm25 = {d: (r, sc) for r, (d, sc) in enumerate(result.bm25, start=1)}
        dense = {d: (r, sc) for r, (d, sc) in enumerate(result.dense, start=1)}
        memory = {d: r for r, (d, _) in enumerate(result.memory, start=1)}
        fused = dict(result.fused)
        ranking = result.reranked if result.reranked is not None else result.fused
        hits = []
        for doc_id, score in ranking[:top_k]:
            doc = self.docs[doc_id]
            b_rank, b_score = bm25.get(doc_id, (None, None))
            d_rank, d_score = dense.get(doc_id, (None, None))
            hits.append(
                Hit(
                    doc_id=doc_id,
                    score=score,
                    title=doc.title,
                    text=doc.text,
                    fused_score=fused[doc_id],
                    bm25_rank=b_rank,
                    bm25_score=b_score,
                    dense_rank=d_rank,
                    dense_score=d_score,
                    memory_rank=memory.get(doc_id),
                    rerank_score=result.rerank_scores.get(doc_id),
                )
            )
        return hits
