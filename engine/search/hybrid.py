"""The hybrid engine: BM25, dense and judgment-memory retrieval, fusion (RRF, or learned when the
index has a trained fusion model), reranking."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from threadpoolctl import threadpool_limits

from engine import telemetry
from engine.config import Settings
from engine.documents import Filters
from engine.fusion.learned import FusionModelError, LearnedFusion
from engine.fusion.rrf import blend_reranking, reciprocal_rank_fusion
from engine.health import FailureCount
from engine.rerank.batching import RerankBatcher
from engine.rerank.cross_encoder import Reranker, RerankerError, Scorer
from engine.rerank.pair_cache import PairCache
from engine.retrieval.dense import DenseRetriever, encode
from engine.retrieval.encoder import load_encoder, load_query_encoder, pick_device
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.memory import JudgmentMemory
from engine.store.docstore import Chunk, DocStore
from engine.store.index_dir import (
    BM25_DIR,
    DOCS_FILE,
    FUSION_DIR,
    MEMORY_DIR,
    WAL_FILE,
    IndexDirError,
    Manifest,
    latest_dense,
    read_manifest,
)

if TYPE_CHECKING:
    from engine.store.live import LiveIndex, Writer

log = logging.getLogger(__name__)


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
    fusion used (``fusion``: the learned model, None for ``rrf``)."""

    bm25: list[tuple[str, float]]
    dense: list[tuple[str, float]]
    memory: list[tuple[str, float]]
    rrf: list[tuple[str, float]]
    fused: list[tuple[str, float]]
    reranked: list[tuple[str, float]] | None
    seconds: dict[str, float] = field(default_factory=dict)
    rerank_scores: dict[str, float] = field(default_factory=dict)
    query_vector: np.ndarray | None = None
    chunks: dict[str, Chunk] = field(default_factory=dict)
    fusion: LearnedFusion | None = None

    @property
    def retrieved(self) -> dict[str, list[tuple[str, float]]]:
        """What each first-stage retriever returned, as the learned fusion reads it."""
        return {"bm25": self.bm25, "dense": self.dense, "memory": self.memory}


def open_reranker(settings: Settings, device: str) -> Reranker | None:
    """The configured reranker on ``device``, or None (said in the log) when the index has none or
    it cannot load; a reranker named explicitly (``--reranker``) that cannot load raises."""
    if not settings.rerank:
        return None
    path = settings.reranker_path
    if settings.reranker is None and not Path(path).is_dir():
        log.warning("no reranker at %s (train one with `hybrid-search train-reranker`); serving fused results", path)
        return None
    try:
        return load_reranker(settings, path, device)
    except RerankerError as exc:
        if settings.reranker is not None:
            raise
        log.warning("%s; serving fused results", exc)
        return None


def load_reranker(settings: Settings, path: str, device: str, cache: bool = True) -> Reranker:
    """The reranker at ``path`` as serving runs it: runtime, quantization, length, batch, and the
    pair cache unless ``cache`` is off (training scores each checkpoint afresh)."""
    s = settings
    return Reranker(
        path,
        device,
        max_length=s.max_length,
        batch_size=s.rerank_batch_for(device),
        runtime=s.rerank_runtime,
        quantize=s.rerank_quantize,
        cache=PairCache(s.rerank_cache_size, s.rerank_cache_s) if cache and s.rerank_cache_size else None,
        length_cap=s.rerank_length_cap(device),
        calibration=int8_calibration(s.index_dir),
    )


def int8_calibration(index_dir: Path, queries: int = 32, per_query: int = 8) -> Callable[[], list[tuple[str, str]]]:
    """Pairs to smooth an int8 reranker on, read when it is quantized: the opening words of
    ``queries`` of the index's documents, each against ``per_query`` others (the channels'
    ranges come from the text, not from relevance: 20 dev queries' top 20 calibrate no better)."""

    def pairs() -> list[tuple[str, str]]:
        store = Path(index_dir) / DOCS_FILE
        chunks = DocStore(store).sample(queries * (per_query + 1)) if store.is_file() else []
        asked, n = chunks[:queries], len(chunks)  # a small store lends its chunks to several pairs
        return [
            (" ".join((c.title or c.text).split()[:8]), chunks[(queries + i * per_query + j) % n].contents)
            for i, c in enumerate(asked)
            for j in range(per_query)
        ]

    return pairs


class HybridEngine:
    """Loads an index directory once; ``search`` is thread-safe and deterministic.

    ``writable`` opens it as its one writer (``self.live``, a :class:`LiveIndex`): documents can
    then be added, replaced and deleted while it serves. A read-only engine refuses an index with
    writes still in its log, since it could not show them.
    """

    def __init__(
        self, settings: Settings, writable: bool = False, reranker: Scorer | None = None, follow: Writer | None = None
    ) -> None:
        """``reranker``: one served elsewhere (a Ray deployment); by default the index's own is loaded.
        ``follow``: the index's writer in another process; this read-only engine takes its writes
        there (``self.live``) and shows its checkpoints (:class:`Follower`)."""
        from engine.store.follower import Follower
        from engine.store.live import LiveIndex, ViewLock, claim_writer

        self.settings = settings
        index_dir = Path(settings.index_dir)
        self.manifest: Manifest = read_manifest(index_dir)
        writer_lock = claim_writer(index_dir) if writable else None
        self.device = pick_device(settings.device)
        self.store = DocStore(index_dir / DOCS_FILE)
        self.bm25 = LuceneIndex(index_dir / BM25_DIR, settings.bm25_k1, settings.bm25_b, writable=writable)
        encoder = load_encoder(self.manifest.encoder, self.device)
        query_encoder = load_query_encoder(encoder, self.manifest.encoder, self.device, settings.query_encoder_runtime)
        dense_path, dense_seq = latest_dense(index_dir)
        self.dense = DenseRetriever(dense_path, encoder, query_encoder, settings.hnsw_ef_search, self.device, writable)
        if writable and not self.dense.accepts_deletes:
            raise IndexDirError(
                f"{index_dir}: a {self.manifest.dense_index} dense index cannot drop vectors, so it takes no live"
                " writes; rebuild with --dense-index flat, or rebuild after changing the corpus"
            )
        self.view_lock = ViewLock()
        self.live: LiveIndex | Writer | None = None
        self.follower: Follower | None = None
        if writable:
            self.live = LiveIndex(self, writer_lock, settings.refresh_interval_s, settings.checkpoint_bytes)
        elif follow is not None:
            self.live, self.follower = follow, Follower(self)
        else:
            self._check_settled(index_dir, dense_seq)
            self.bind_units()
        self.memory = self._load_memory(index_dir)
        self.fusion = self._load_fusion(index_dir / FUSION_DIR)
        self.reranker = self._load_reranker(reranker)
        self.reranker_health = FailureCount()

    def _check_settled(self, index_dir: Path, dense_seq: int) -> None:
        seqs = {self.bm25.committed_seq(), dense_seq, self.store.meta("applied_seq")}
        wal = index_dir / WAL_FILE
        if len(seqs) > 1 or (wal.exists() and wal.stat().st_size > 0):
            raise IndexDirError(
                f"{index_dir}: live writes are not checkpointed yet (a server is writing it, or one stopped"
                " without a checkpoint); run `hybrid-search compact` when no server writes it"
            )

    def bind_units(self) -> None:
        """Name the dense rows by the store's map; refuses stores that disagree (a missing or stale
        file), which would otherwise answer with the wrong documents."""
        self.dense.bind(self.store.unit_ids_by_row())
        if self.bm25.documents != len(self.dense.units):
            raise IndexDirError(
                f"{self.bm25.path}: {self.bm25.documents} documents for {len(self.dense.units)} in the store"
                f" ({DOCS_FILE}); rebuild the index"
            )

    def encode_texts(self, texts: list[str]) -> np.ndarray:
        """Dense vectors for new chunks, batched, on the engine's device."""
        return encode(self.dense.encoder, texts, self.settings.encode_batch_size)

    def close(self) -> None:
        """Checkpoint live writes (if any) and release the index."""
        if self.live is not None:
            self.live.close()
        self.bm25.close()
        self.store.close()

    def _load_memory(self, index_dir: Path) -> JudgmentMemory | None:
        if not self.settings.memory or not (index_dir / MEMORY_DIR).is_dir():
            return None
        # numpy's BLAS products here are a query's (the memory's votes: ~1 MFLOP), as fast on one
        # thread; on all cores, BLAS's threads spin after each and slowed the reranker run next to
        # them by ~50 ms on 2 cores (docs/experiments.md). Process-wide: the engine owns the process.
        threadpool_limits(1, user_api="blas")
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

    def _load_reranker(self, given: Scorer | None) -> Scorer | None:
        reranker = given if given is not None else open_reranker(self.settings, self.device)
        if reranker is None:
            return None
        missing = self.missing_memory_context() if reranker.memory_context else None
        if missing:
            message = f"{reranker.name} reads each document after the training queries that cited it, and {missing}"
            if self.settings.reranker is not None:
                raise RerankerError(message)
            log.warning("%s; serving fused results", message)
            return None
        if given is None and self.device == "cuda" and self.settings.rerank_batch_wait_ms > 0:
            return RerankBatcher(reranker, self.settings.rerank_batch_wait_ms / 1000)
        return reranker

    @property
    def rerank_depth(self) -> int:
        """Fused candidates the reranker rescores: the default follows where the reranker runs."""
        return self.rerank_plan(AS_LOADED)[1]

    def rerank_plan(self, options: SearchOptions) -> tuple[Scorer | None, int]:
        """The reranker a call uses and how deep (None, 0: no reranking)."""
        reranker = options.reranker or self.reranker
        if reranker is None or options.rerank_depth == 0:
            return None, 0
        return reranker, options.rerank_depth or self.settings.rerank_depth_for(reranker.device)

    def missing_memory_context(self) -> str | None:
        """Why this engine cannot give a memory-aware reranker its context, or None when it can."""
        if self.memory is None:
            return "this engine has no judgment memory"
        if self.memory.texts is None:
            return "this index's memory keeps no query texts (rebuild it with `hybrid-search build`)"
        return None

    def stages(
        self,
        query: str,
        top_k: int = 10,
        exclude: str | None = None,
        filters: Filters | None = None,
        options: SearchOptions = AS_LOADED,
    ) -> StageResult:
        """Run every stage; the reranker rescores the fused top ``max(rerank_depth, top_k)``.

        ``exclude`` names a training query to leave out of the judgment memory, so that training
        and mining see a training query's candidates as a new query would (without its own labels).
        ``filters`` narrow every retriever inside its own search. Retrieval runs under the view
        lock's shared side (a refresh applies writes between searches, never during one); the
        reranker runs after it, on the texts read under the lock. A reranker that fails leaves the
        fused order (``reranked`` None) and is counted in ``reranker_health``.
        """
        s = self.settings
        seconds: dict[str, float] = {}
        reranker, rerank_depth = self.rerank_plan(options)
        fusion = options.fusion or self.fusion
        if self.follower is not None:
            self.follower.catch_up()
        with self.view_lock.reading():
            t0 = time.perf_counter()
            allowed = self.store.matching(filters) if filters is not None and not filters.empty else None
            live = allowed if allowed is not None else self.dense.rows
            # only chunks the store holds: Lucene's view lags the others when its refresh failed (a full disk)
            bm25 = [hit for hit in self.bm25.search(query, max(s.bm25_depth, top_k), allowed) if hit[0] in live]
            t1 = time.perf_counter()
            vector = self.dense.encode_query(query)
            t_enc = time.perf_counter()
            rows = list(allowed.values()) if allowed is not None else None
            dense = self.dense.search(vector, max(s.dense_depth, top_k), rows)
            t_dense = time.perf_counter()
            memory = self.memory.search(vector, s.memory_depth, exclude, live) if self.memory else []
            t2 = time.perf_counter()
            rankings = {"bm25": [d for d, _ in bm25], "dense": [d for d, _ in dense], "memory": [d for d, _ in memory]}
            weights = {"bm25": s.bm25_weight, "dense": s.dense_weight, "memory": s.memory_weight}
            rrf = reciprocal_rank_fusion(rankings, k=s.rrf_k, weights=weights)
            found = {"bm25": bm25, "dense": dense, "memory": memory}
            fused = fusion.rank(query, found, rrf) if fusion is not None else rrf
            depth = max(rerank_depth, top_k)
            chunks = self.store.chunks(d for d, _ in fused[:depth])
            if self.follower is not None:  # the shared store may have dropped what this view still holds
                fused = [hit for hit in fused[:depth] if hit[0] in chunks] + fused[depth:]
            t3 = time.perf_counter()
        seconds.update(bm25=t1 - t0, encode=t_enc - t1, dense=t_dense - t_enc, memory=t2 - t_dense, fusion=t3 - t2)
        reranked, rerank_scores = None, {}
        if reranker is not None and fused:
            try:
                reranked = self.rerank(query, fused, rerank_scores, top_k, vector, exclude, chunks, options)
            except Exception as exc:  # a failing model must not fail the query: the fused order serves
                self.reranker_health.failed(exc)
                log.warning("reranker failed (%s: %s); serving fused results", type(exc).__name__, exc)
                rerank_scores = {}
            else:
                self.reranker_health.ok()
            seconds["rerank"] = time.perf_counter() - t3
        seconds["total"] = time.perf_counter() - t0
        asked_found = {  # for the stage spans: candidates asked for and found (None: the reranker failed)
            "bm25": (max(s.bm25_depth, top_k), len(bm25)),
            "dense": (max(s.dense_depth, top_k), len(dense)),
            "memory": (s.memory_depth, len(memory)),
            "fusion": (None, len(fused)),
            "rerank": (depth, None if reranked is None else len(reranked)),
        }
        telemetry.record_stages(t0, seconds, top_k, asked_found)
        return StageResult(bm25, dense, memory, rrf, fused, reranked, seconds, rerank_scores, vector, chunks, fusion)

    def rerank(
        self,
        query: str,
        ranking: list[tuple[str, float]],
        scores: dict[str, float],
        top_k: int = 1,
        vector: np.ndarray | None = None,
        exclude: str | None = None,
        chunks: Mapping[str, Chunk] | None = None,
        options: SearchOptions = AS_LOADED,
    ) -> list[tuple[str, float]]:
        """The head of ``ranking`` (``max(rerank_depth, top_k)`` documents with their first-stage scores)
        reordered by the reranker, blended with the first stage (``rerank_blend``). ``scores`` caches
        cross-encoder scores: documents already in it are not scored again and new ones are added, so
        several rankings of one query share the work. ``vector`` (the query's embedding, encoded when
        not given) and ``exclude`` pick a memory-aware reranker's context, as for the memory's votes.
        """
        reranker, depth = self.rerank_plan(options)
        head = ranking[: max(depth, top_k)]
        todo = [d for d, _ in head if d not in scores]
        if todo:
            passages = self.rerank_passages(query, todo, reranker.memory_context, vector, exclude, chunks)
            scores.update(zip(todo, reranker.score(query, passages), strict=True))
        return blend_reranking(head, [scores[d] for d, _ in head], self.settings.rerank_blend)

    def rerank_passages(
        self,
        query: str,
        doc_ids: list[str],
        context: int,
        vector: np.ndarray | None = None,
        exclude: str | None = None,
        chunks: Mapping[str, Chunk] | None = None,
    ) -> list[str]:
        """What a reranker reads for each document: its text, after the ``context`` training queries
        nearest the query that cited it when the reranker was trained that way (``memory_context``
        in its model card; training builds its pairs here too). ``chunks`` are texts already read
        (the store is asked for the others)."""
        known = dict(chunks or {})
        missing = [d for d in doc_ids if d not in known]
        if missing:
            known.update(self.store.chunks(missing))
        if not context:
            return [known[d].contents for d in doc_ids]
        if vector is None:
            vector = self.dense.encode_query(query)
        cited = (self.memory.cited_for(vector, d, context, exclude) for d in doc_ids)
        return [f"{c} {known[d].contents}" for c, d in zip(cited, doc_ids, strict=True)]

    def describe(self) -> dict:
        """How this engine fuses and reranks, defaults resolved: what health checks and run summaries
        report."""
        r, s = self.reranker, self.settings
        calibrated = self.fusion is not None and self.fusion.calibration is not None
        return {
            "stages": ["bm25", "dense"] + ["memory"] * (self.memory is not None) + ["fusion"] + ["rerank"] * bool(r),
            "fusion": f"learned ({self.fusion.describe()})" if self.fusion else "rrf",
            "similarity_score": "calibrated probability of relevance"
            if calibrated
            else "query-chunk cosine in 0-1, falling down the list; not a probability (no training judgments)",
            "reranker": r.name if r else None,
            "query_encoder_runtime": self.dense.query_encoder.runtime,
            "reranker_runtime": r.runtime if r else None,
            "rerank_depth": self.rerank_depth,
            "rerank_blend": s.rerank_blend if r else None,
            "rerank_max_length": r.max_length if r else None,
            "rerank_memory_context": r.memory_context if r else None,
        }

    def search(
        self,
        query: str,
        top_k: int = 5,
        filters: Filters | None = None,
        similarity_threshold: float | None = None,
        options: SearchOptions = AS_LOADED,
    ) -> list[Hit]:
        """``top_k`` unique chunks, best first; fewer only if fewer match the filters or reach the
        threshold (on :meth:`similarity`)."""
        if not query.strip():
            raise ValueError("query is empty")
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        result = self.stages(query, top_k, filters=filters, options=options)
        return self.hits(result, top_k, similarity_threshold)

    def similarity(self, result: StageResult, ranking: list[tuple[str, float]]) -> list[float]:
        """What ``similarity_score`` means: with a calibrated fusion, the probability that the hit is
        relevant (from its fused score and final rank); without one (no training judgments), the
        cosine of the query and the chunk in 0-1 (a chunk pointing away from the query is as
        dissimilar as one at right angles), never above the score of the hit ranked before it, so
        the scores fall down the list and a threshold keeps a prefix of the ranking. Without
        judgments it is a similarity, not a probability."""
        calibration = result.fusion.calibration if result.fusion is not None else None
        if calibration is None:
            cosines = self.dense.similarity(result.query_vector, [d for d, _ in ranking])
            return list(itertools.accumulate((min(1.0, max(0.0, c)) for c in cosines), min))
        fused = dict(result.fused)
        return [calibration.probability(fused[d], rank) for rank, (d, _) in enumerate(ranking, start=1)]

    def hits(self, result: StageResult, top_k: int, similarity_threshold: float | None = None) -> list[Hit]:
        bm25 = {d: (r, sc) for r, (d, sc) in enumerate(result.bm25, start=1)}
        dense = {d: (r, sc) for r, (d, sc) in enumerate(result.dense, start=1)}
        memory = {d: r for r, (d, _) in enumerate(result.memory, start=1)}
        fused = dict(result.fused)
        ranking = (result.reranked if result.reranked is not None else result.fused)[:top_k]
        chunks = {**self.store.chunks(d for d, _ in ranking if d not in result.chunks), **result.chunks}
        hits = []
        for (doc_id, score), similarity in zip(ranking, self.similarity(result, ranking), strict=True):
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
        return hits
