"""The hybrid engine as loaded: an index directory's retrievers, fusion and reranker, opened once and
searched by many threads (the stages a query runs are in :mod:`engine.search.stages`)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from threadpoolctl import threadpool_limits

from engine import telemetry
from engine.documents import RETRIEVER_NAME, FacetRequest, Filters, QueryRequest
from engine.fusion.graph import CARD_SHOWN, AdaptedStageError, CorpusGraph, load_adapted
from engine.fusion.learned import FusionModelError, LearnedFusion
from engine.health import FailureCount
from engine.rerank.batching import RerankBatcher
from engine.rerank.cross_encoder import PairScorer, RerankerError, Scorer
from engine.rerank.loading import open_reranker
from engine.rerank.token_source import PairInputs
from engine.retrieval.dense import DenseRetriever
from engine.retrieval.encoder import pick_device
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.memory import JudgmentMemory
from engine.retrieval.protocol import Ranking, Retriever
from engine.search import answers, stages
from engine.search.controls import search_options
from engine.search.highlights import SentenceVectors
from engine.search.opening import LOCAL, OpenIndex, Remotes, open_view
from engine.search.pages import PinFile, Pins
from engine.search.results import AS_LOADED, Hits, SearchOptions, StageResult
from engine.search.spare import SpareThreads
from engine.settings import EngineSettings
from engine.store.docstore import Chunk, DocStore
from engine.store.index_dir import (
    ADAPT_DIR,
    FUSION_DIR,
    MEMORY_DIR,
    Manifest,
)

if TYPE_CHECKING:
    from engine.live.locks import ViewLock
    from engine.live.view import IndexView
    from engine.live.writer import LiveIndex, Writer

log = logging.getLogger(__name__)


class HybridEngine:
    """An opened index (:func:`~engine.search.opening.open_view`) with what a search runs over it:
    the judgment memory, fusion and the reranker; ``search`` is thread-safe and deterministic.

    ``writable`` opens the index as its one writer (``self.live``, a :class:`LiveIndex`): documents
    can then be added, replaced and deleted while it serves. A read-only engine refuses an index with
    writes still in its log, since it could not show them.
    """

    def __init__(
        self,
        settings: EngineSettings,
        writable: bool = False,
        reranker: Scorer | None = None,
        remotes: Remotes = LOCAL,
    ) -> None:
        """``reranker``: one served elsewhere (a Ray deployment) or shared by several indexes; by
        default the index's own is loaded. ``remotes``: what other processes serve (the index's
        writer, which makes this engine its follower, a sharded index's shards) and models already
        loaded (:class:`~engine.search.opening.Remotes`)."""
        self.settings = settings
        role = "writer" if writable else "follower" if remotes.writer is not None else "reader"
        self.index: OpenIndex = open_view(settings, role, remotes)
        self.manifest: Manifest = self.index.manifest
        self.device = pick_device(settings.device)
        self.retrieval_device = self.index.retrieval_device
        index_dir = Path(settings.index_dir)
        self.memory = self._load_memory(index_dir)
        self.registered: dict[str, Retriever] = {}  # retrievers added beside the index's own (register)
        self.fusion = self._load_fusion(index_dir / FUSION_DIR)
        self.adapted, self.adapt_card = self._load_adapted(index_dir / ADAPT_DIR)
        self._pair_inputs: dict[tuple[str, bool], PairInputs] = {}
        self._pair_inputs_lock = threading.Lock()
        self.reranker = self._load_reranker(reranker)
        if self.reranker is not None:
            self.pair_inputs(self.reranker)  # token ids computed at load when the store lacks them
        self.reranker_health = FailureCount()
        self.stage_observers: list[Callable[[Mapping[str, float]], None]] = []
        pins = remotes.pins or PinFile(settings.page_pins, settings.page_pin_seconds, settings.page_pins_file)
        self.pins = Pins(pins, settings.page_pin_seconds)  # rankings, for pages
        self.spare = SpareThreads(settings.spare_threads)  # a query's work beside it: spare.py
        self.sentences = SentenceVectors()  # each highlighted chunk's sentence vectors, kept

    # the stores, as the view holds them now (a follower, or the writer after a merge, swaps its dense)
    @property
    def view(self) -> IndexView:
        return self.index.view

    @property
    def live(self) -> LiveIndex | Writer | None:
        """Who takes this index's writes (None: read-only)."""
        return self.index.live

    @property
    def store(self) -> DocStore:
        return self.view.store

    @property
    def bm25(self) -> LuceneIndex:
        return self.view.bm25

    @property
    def dense(self) -> DenseRetriever:
        return self.view.dense

    @property
    def view_lock(self) -> ViewLock:
        return self.view.lock

    def retrievers(self) -> dict[str, Retriever | None]:
        """The first-stage retrievers a search runs, by name, in the order fusion reads them (None:
        the index has no memory); read per search, since a follower swaps its dense view. Each
        one's depth and weight are settings of its name (:meth:`EngineSettings.retriever`)."""
        return {"bm25": self.bm25, "dense": self.dense, "memory": self.memory, **self.registered}

    def register(self, name: str, retriever: Retriever) -> None:
        """One more first-stage retriever, fused, explained and controlled per request by ``name``
        like the index's own (a learned fusion reads only those it was trained on)."""
        if name in self.retrievers() or not re.fullmatch(RETRIEVER_NAME, name):
            raise ValueError(f"{name!r}: a retriever's name is new and matches {RETRIEVER_NAME}")
        self.registered[name] = retriever

    def options_for(self, request: QueryRequest) -> SearchOptions:
        """A door's request as this engine's options; InvalidControl (422) names a field it cannot honour."""
        return search_options(request, self)

    def fusion_for(self, options: SearchOptions) -> LearnedFusion | None:
        """The learned fusion a call uses (None: RRF, with the corpus graph when one serves)."""
        return None if options.method == "rrf" else options.fusion or self.fusion

    def close(self) -> None:
        """Checkpoint live writes (if any) and release the index."""
        self.spare.close()
        self.index.close()

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

    def _load_adapted(self, folder: Path) -> tuple[CorpusGraph | None, dict | None]:
        """What `build --adapt` stored, served when its held-out check paid, no learned fusion (from
        judgments) replaces it and ``adapted`` is on."""
        try:
            graph, card = load_adapted(folder)
        except AdaptedStageError as exc:
            log.warning("%s; serving RRF", exc)
            return None, None
        if self.fusion is not None or self.memory is not None or not self.settings.adapted:
            return None, card
        return graph, card

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
            return RerankBatcher(reranker, self.settings.rerank_batch_wait_ms / 1000, self.settings.rerank_batch_tokens)
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

    def pair_inputs(self, reranker: Scorer) -> PairInputs | None:
        """The token ids ``reranker``'s pairs are made from, for its tokenizer (made on first use);
        None for a reranker that reads texts."""
        tokenizer = reranker.text_tokens if isinstance(reranker, PairScorer) else None
        if tokenizer is None:
            return None
        if self.index.shards is not None and tokenizer.recipe != self.manifest.passage_tokens:
            return None  # a sharded store's ids are the build's tokenizer's; others tokenize the texts they read
        key = (tokenizer.fingerprint, reranker.memory_context > 0)
        with self._pair_inputs_lock:
            if key not in self._pair_inputs:
                memory = self.memory if reranker.memory_context else None
                index_dir = Path(self.settings.index_dir)
                self._pair_inputs[key] = PairInputs(tokenizer, self.store, index_dir, self.manifest, memory)
            return self._pair_inputs[key]

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
        return stages.run_stages(self, query, top_k, exclude, filters, options)

    def rerank(
        self,
        query: str,
        ranking: Ranking,
        scores: dict[str, float],
        top_k: int = 1,
        vector: np.ndarray | None = None,
        exclude: str | None = None,
        chunks: Mapping[str, Chunk] | None = None,
        options: SearchOptions = AS_LOADED,
    ) -> Ranking:
        """The head of ``ranking`` (``max(rerank_depth, top_k)`` documents with their first-stage scores)
        reordered by the reranker, blended with the first stage (``rerank_blend``). ``scores`` caches
        cross-encoder scores: documents already in it are not scored again and new ones are added, so
        several rankings of one query share the work. ``vector`` (the query's embedding, encoded when
        not given) and ``exclude`` pick a memory-aware reranker's context, as for the memory's votes.
        """
        return stages.rerank(self, query, ranking, scores, top_k, vector, exclude, chunks, options)

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
        return stages.passages(self, query, doc_ids, context, vector, exclude, chunks)[0]

    def warm_up(self, searches: int) -> float:
        """:meth:`OpenIndex.warm_up`: Lucene's search path compiled before queries come."""
        return self.index.warm_up(searches)

    def describe(self) -> dict:
        """How this engine fuses and reranks, defaults resolved: what health checks and run summaries
        report."""
        r, s = self.reranker, self.settings
        calibrated = self.fusion is not None and self.fusion.calibration is not None
        graph, card = self.adapted, self.adapt_card
        return {
            "stages": ["bm25", "dense"]
            + ["memory"] * (self.memory is not None)
            + ["fusion"]
            + ["corpus_graph"] * (graph is not None)
            + ["rerank"] * bool(r),
            "fusion": f"learned ({self.fusion.describe()})"
            if self.fusion
            else f"rrf + corpus graph ({graph.k} neighbours, weight {graph.weight})"
            if graph
            else "rrf",
            "adapted": None if card is None else {k: card.get(k) for k in CARD_SHOWN},
            "similarity_score": "calibrated probability of relevance"
            if calibrated
            else "query-chunk cosine in 0-1, falling down the list; not a probability (no training judgments)",
            "reranker": r.name if r else None,
            "query_encoder_runtime": self.dense.query_encoder.runtime,
            "retrieval_device": self.retrieval_device,
            "dense_backend": self.dense.backend,
            "reranker_runtime": r.runtime if r else None,
            "reranker_plan": getattr(r, "running", None) if r else None,  # a Ray deployment's client shows none
            "rerank_depth": self.rerank_depth,
            "rerank_blend": s.rerank_blend if r else None,
            "rerank_max_length": r.max_length if r else None,
            "rerank_gflop_per_query": _gflop(r, self.rerank_depth),
            "rerank_memory_context": r.memory_context if r else None,
        }

    def search(
        self,
        query: str,
        top_k: int = 5,
        filters: Filters | None = None,
        similarity_threshold: float | None = None,
        options: SearchOptions = AS_LOADED,
        door: str = "engine",
    ) -> Hits:
        """``top_k`` unique chunks, best first; fewer only if fewer match the filters or reach the
        threshold (on :func:`~engine.search.answers.similarity`), or a sharded index's shard did not
        answer (``missing_shards``).
        With ``options.paginate`` the ranking is pinned and the hits carry the next page's token;
        with ``options.page_token`` that page is read off the pinned ranking (:mod:`engine.search.pages`).

        The one way a query is answered: every door, agent and the solver search here (``door``
        names who asked), so each search gets one ``search`` span with its stage spans, and its
        stage times go to every :attr:`stage_observers` (the server's metrics) once."""
        if not query.strip():
            raise ValueError("query is empty")
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        with telemetry.search_span(door, query, top_k, filtered=filters is not None) as span:
            if options.page_token is not None:  # a later page: read off the ranking its token pinned
                pin, offset, result = self.pins.page(options.page_token, options.fingerprint)
                result.fusion = self.fusion_for(options)
            else:
                result = self.stages(query, top_k, filters=filters, options=options)
                for observe in self.stage_observers:
                    observe(result.seconds)
                pin, offset = None, 0
            hits = answers.hits(self, result, top_k, similarity_threshold, options.explain, options.group_size, offset)
            if options.paginate and hits.more:  # pinned with what this page read
                hits.next_page_token = self.pins.keep(pin, result, offset + top_k, options.fingerprint)
            answers.passages(self, hits, result, options)
            span.set_attribute("search.hits", len(hits))
        return hits

    def facets(self, request: FacetRequest) -> list[tuple[object, int]]:
        """(value, count) of ``request.key``'s most held values among the chunks its filters allow
        or, with a query, among that query's fused candidates (:meth:`DocStore.facets`)."""
        rows, filters = None, request.filters
        if request.query is not None:
            every = SearchOptions(rerank_depth=0, whole_ranking=True)
            result = self.stages(request.query, 1, filters=filters, options=every)
            found = self.dense.units.rows_of([d for d, _ in result.fused])
            rows, filters = [int(r) for r in found if r >= 0], None  # the candidates hold the filters already
        counts = self.store.facets(request.key, filters, rows, request.size if request.count == "chunks" else None)
        by = 1 if request.count == "chunks" else 2
        return sorted(((found[0], found[by]) for found in counts), key=lambda c: -c[1])[: request.size]


def _gflop(reranker, depth: int) -> float | None:
    """A query's reranking work at ``depth`` (None: no reranker, or one that does not say)."""
    per_pair = getattr(reranker, "gflop_per_pair", None) if reranker else None
    return round(per_pair * depth, 1) if per_pair else None
