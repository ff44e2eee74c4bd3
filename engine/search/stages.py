"""What one query runs: the retrievers under the index's view, fusion, then the reranker.

Each function takes the loaded :class:`~engine.search.hybrid.HybridEngine` and times its stages on
one :class:`~engine.search.stopwatch.Stopwatch`, whose figures the latency reports, the metrics and
the OpenTelemetry stage spans all read.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import wait
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from engine import telemetry
from engine.documents import Filters
from engine.errors import ServiceError
from engine.fusion.learned import LearnedFusion
from engine.fusion.rrf import blend_reranking, reciprocal_rank_fusion
from engine.rerank.cross_encoder import PairScorer
from engine.rerank.pair_assembly import PassageTokens
from engine.rerank.token_source import PairInputs
from engine.retrieval.lucene import IndexClosedError
from engine.retrieval.protocol import Query, Ranking, Retriever, Within
from engine.search.results import AS_LOADED, Plan, SearchOptions, StageResult
from engine.search.stopwatch import Stopwatch
from engine.shards.fanout import missing_shards, track_missing
from engine.store.docstore import Chunk

if TYPE_CHECKING:
    from engine.search import HybridEngine

log = logging.getLogger(__name__)


class RetrieverFailed(ServiceError):
    """A retriever failed inside a search (500); ``retriever`` says which ("bm25" or "dense"), for
    the protocols whose error codes tell them apart (the agent protocol's LEXICAL_SEARCH_FAILED and
    VECTOR_SEARCH_FAILED)."""

    def __init__(self, retriever: str, cause: BaseException) -> None:
        super().__init__(f"{retriever} retrieval failed: {type(cause).__name__}: {cause}")
        self.retriever = retriever


@contextmanager
def _retriever(name: str) -> Iterator[None]:
    """A failure inside the block is ``name``'s (the engine's own declared failures pass as they are)."""
    try:
        yield
    except (ServiceError, IndexClosedError):
        raise
    except Exception as exc:
        raise RetrieverFailed(name, exc) from exc


def run_stages(
    engine: HybridEngine,
    query: str,
    top_k: int = 10,
    exclude: str | None = None,
    filters: Filters | None = None,
    options: SearchOptions = AS_LOADED,
) -> StageResult:
    """Every stage for one query (:meth:`HybridEngine.stages` says what each argument means), with
    the shards a sharded index's search went without (:mod:`engine.shards.fanout`)."""
    token = track_missing()
    try:
        with engine.spare.query():
            result = _run_stages(engine, query, top_k, exclude, filters, options)
    finally:
        missing = missing_shards(token)
    result.missing_shards = missing
    return result


def _run_stages(
    engine: HybridEngine,
    query: str,
    top_k: int,
    exclude: str | None,
    filters: Filters | None,
    options: SearchOptions,
) -> StageResult:
    s = engine.settings
    reranker, rerank_depth = engine.rerank_plan(options)
    fusion = engine.fusion_for(options)
    engine.index.catch_up()
    retrievers = engine.retrievers()
    watch = Stopwatch(retrievers)
    with _retriever("dense"):
        vector = engine.dense.encode_query(query)  # before the view lock: a refresh never waits on the encoder
    watch.lap("encode")
    configured = {name: s.retriever(name) for name in retrievers}
    depths = {name: max(options.depths.get(name, part.depth), top_k) for name, part in configured.items()}
    weights = {name: options.weights.get(name, part.weight) for name, part in configured.items()}
    rrf_k = options.rrf_k or s.rrf_k
    depth = max(rerank_depth, top_k)
    need = None if options.group_size or options.paginate or options.whole_ranking else depth
    with engine.view_lock.reading():
        within, asked = engine.index.within(filters), Query(query, vector, exclude)
        passes = _Passes(engine, retrievers, asked, depths, weights, rrf_k, fusion, options, watch)
        if within.allowed is None:
            (found, rrf, fused), whole = passes.run(within), True
        else:
            found, rrf, fused, whole = _filtered(passes, within, need)
        chunks = engine.store.chunks(d for d, _ in fused[:depth])
        if engine.index.reads_ahead:  # a store ahead of the view, or a
            fused = _held(engine, fused, depth, chunks)  # shard's writes or loss since it answered
            if len(fused) < depth and not whole:  # the head lost chunks: search within the filter too
                found, rrf, fused, whole = _filtered(passes, within, None)
                chunks = engine.store.chunks(d for d, _ in fused[:depth])
                fused = _held(engine, fused, depth, chunks)
        head = [d for d, _ in fused[:depth]] if fusion is None or fusion.calibration is None else []
        cosines = dict(zip(head, engine.dense.similarity(vector, head), strict=True))
        watch.lap("fusion")
    method = passes.method
    reranked, rerank_scores = None, {}
    if reranker is not None and fused:
        try:
            reranked = rerank(engine, query, fused, rerank_scores, top_k, vector, exclude, chunks, options, watch)
        except Exception as exc:  # a failing model must not fail the query: the fused order serves
            engine.reranker_health.failed(exc)
            log.warning("reranker failed (%s: %s); serving fused results", type(exc).__name__, exc)
            rerank_scores = {}
        else:
            engine.reranker_health.ok()
        watch.lap("rerank")
    seconds = watch.stop()
    asked_found = {  # for the stage spans: candidates asked for and found (None: the reranker failed)
        **{name: (depths[name], len(hits)) for name, hits in found.items()},
        "fusion": (None, len(fused)),
        "rerank": (depth, None if reranked is None else len(reranked)),
    }
    telemetry.record_stages(watch.spans, top_k, asked_found)
    plan = Plan(query, depths, weights, rrf_k, method, s.rerank_blend)
    return StageResult(found, rrf, fused, reranked, seconds, rerank_scores, vector, chunks, fusion, cosines, plan=plan)


BESIDE = "dense"  # the retriever a query's pass may run beside the others (:meth:`_Passes._beside`)


class _Passes:
    """One query's passes over the retrievers: each retriever's candidates within what a pass may
    return (each timed as its retriever's stage), fused as the request asks (timed as fusion)."""

    def __init__(
        self,
        engine: HybridEngine,
        retrievers: Mapping[str, Retriever | None],
        asked: Query,
        depths: Mapping[str, int],
        weights: Mapping[str, float],
        rrf_k: float,
        fusion: LearnedFusion | None,
        options: SearchOptions,
        watch: Stopwatch,
    ) -> None:
        self.engine, self.retrievers, self.asked, self.watch = engine, retrievers, asked, watch
        self.depths, self.weights, self.rrf_k, self.fusion = depths, weights, rrf_k, fusion
        if fusion is not None:
            self.method = "learned"
        elif engine.adapted is not None and options.method is None:
            self.method = "rrf + corpus graph"
        else:
            self.method = "rrf"

    def run(self, within: Within, watch: Stopwatch | None = None) -> tuple[dict[str, Ranking], Ranking, Ranking]:
        """Each retriever's hits within ``within``, their RRF and the fused ranking (timed on
        ``watch``, by default the query's)."""
        watch = watch or self.watch
        found = {}
        beside = self._beside(within)
        try:
            for name, retriever in self.retrievers.items():  # in the stopwatch's order
                if beside is not None and name == BESIDE:
                    continue
                with _retriever(name):
                    found[name] = [] if retriever is None else retriever.retrieve(self.asked, self.depths[name], within)
                watch.lap(name)
        finally:
            if beside is not None:  # it reads the view this search's lock holds: never left running past it
                wait([beside])
        if beside is not None:
            with _retriever(BESIDE):
                found[BESIDE], start, end = beside.result()
            watch.beside(BESIDE, start, end)
            found = {name: found[name] for name in self.retrievers}  # fusion reads them in this order
        rrf = self.rrf(found)
        if self.method == "learned":
            fused = self.fusion.rank(self.asked.text, found, rrf)
        elif self.method == "rrf + corpus graph":
            fused = self.engine.adapted.rerank(rrf, self.engine.dense.units)
        else:
            fused = rrf
        watch.lap("fusion")
        return found, rrf, fused

    def _beside(self, within: Within):
        """The dense retriever started on a spare thread while this is the process's only query
        (None: it runs in turn). FAISS lets go of the GIL for the whole search, so on the core the
        query leaves idle it costs nothing while BM25 and the memory run; with other queries in
        progress the cores are busy, and the hand-over would only add work."""
        retriever = self.retrievers.get(BESIDE)
        if retriever is None or len(self.retrievers) < 2:
            return None

        def timed():
            started = time.perf_counter_ns()
            return retriever.retrieve(self.asked, self.depths[BESIDE], within), started, time.perf_counter_ns()

        return self.engine.spare.start(timed, alone=True)

    def narrow(self, within: Within, need: int) -> bool:
        """Whether a filter is too narrow for the unfiltered pass to hold ``need`` of its chunks:
        its share of the index times the most candidates that pass can hold (the retrievers'
        depths summed) is fewer. A wider one (a tenth of the index, at depths of 100 and 10 hits)
        is mostly answered by the first pass alone, and a second pass beside it would be waited
        for, for nothing."""
        if within.rows is None:  # a sharded index's filter: its size is the shards' to count
            return False
        return len(within.allowed) * sum(self.depths.values()) < need * len(self.engine.dense.units)

    def rrf(self, found: Mapping[str, Ranking]) -> Ranking:
        ranks = {name: [d for d, _ in hits] for name, hits in found.items()}
        return reciprocal_rank_fusion(ranks, k=self.rrf_k, weights=self.weights)


def _filtered(passes: _Passes, within: Within, need: int | None) -> tuple[dict[str, Ranking], Ranking, Ranking, bool]:
    """A filtered search: the unfiltered ranking's allowed chunks in its order, so that a filter
    leaves chunks out of the ranking and never reorders it (ranks within the filter would move RRF's
    and the learned fusion's scores); where those are fewer than the ``need`` the caller reads
    (None: every candidate), a second pass within the filter adds those only it finds (deeper than
    the unfiltered candidates reach) in its fused order. An allowed chunk of a retriever's
    unfiltered top ``depth`` is in its filtered top ``depth`` too, at the rank it holds among the
    allowed ones: without the second pass, the retrievers' hits and RRF are the allowed ones of the
    first, ranked as the second pass would rank them; the flag says whether the second pass ran.

    A filter too narrow for the first pass to hold ``need`` of its chunks has its second pass run
    beside the first on a spare thread while one is idle (:mod:`engine.search.spare`), the wait
    for it timed as fusion."""
    ahead = None
    if need is not None and passes.narrow(within, need):
        ahead = passes.engine.spare.start(functools.partial(passes.run, within, Stopwatch(passes.retrievers)))
    try:
        found, _, whole = passes.run(Within(passes.engine.dense.units))
        seen = list(dict.fromkeys(d for hits in (whole, *found.values()) for d, _ in hits))
        allowed = {d for d, held in zip(seen, within.allowed.contains(seen).tolist(), strict=True) if held}
    except BaseException:
        if ahead is not None:  # it reads the view this search's lock holds: never left running past it
            wait([ahead])
        raise
    first = [hit for hit in whole if hit[0] in allowed]
    if need is not None and len(first) >= need:
        if ahead is not None:
            wait([ahead])  # as above: its answer is not needed
        found = {name: [hit for hit in hits if hit[0] in allowed] for name, hits in found.items()}
        return found, passes.rrf(found), first, False
    if ahead is not None:
        found, rrf, fused = ahead.result()
        passes.watch.lap("fusion")  # the wait for it
    else:
        found, rrf, fused = passes.run(within)
    kept = {d for d, _ in first}
    return found, rrf, first + [hit for hit in fused if hit[0] not in kept], True


def _held(engine: HybridEngine, fused: Ranking, depth: int, chunks: dict[str, Chunk]) -> Ranking:
    """``fused`` without the chunks the store no longer holds, its head of ``depth`` refilled from
    further down (their chunks added to ``chunks``), so that every hit served has its chunk."""
    head, rest = [hit for hit in fused[:depth] if hit[0] in chunks], fused[depth:]
    while len(head) < depth and rest:
        more, rest = rest[: depth - len(head)], rest[depth - len(head) :]
        found = engine.store.chunks(d for d, _ in more)
        chunks.update(found)
        head += [hit for hit in more if hit[0] in found]
    return head + rest


def rerank(
    engine: HybridEngine,
    query: str,
    ranking: Ranking,
    scores: dict[str, float],
    top_k: int = 1,
    vector: np.ndarray | None = None,
    exclude: str | None = None,
    chunks: Mapping[str, Chunk] | None = None,
    options: SearchOptions = AS_LOADED,
    watch: Stopwatch | None = None,
) -> Ranking:
    """The head of ``ranking`` reordered by the reranker (:meth:`HybridEngine.rerank`); ``watch``
    times making the pairs (``pairs``) apart from scoring them."""
    reranker, depth = engine.rerank_plan(options)
    head = ranking[: max(depth, top_k)]
    todo = [d for d, _ in head if d not in scores]
    apart = isinstance(reranker, PairScorer)  # else a scorer that takes texts (one served elsewhere)
    if todo:
        inputs = engine.pair_inputs(reranker)
        texts, tokens = passages(engine, query, todo, reranker.memory_context, vector, exclude, chunks, inputs)
        prepared = reranker.prepare(query, texts, tokens) if apart else None
    if watch is not None:
        watch.lap("pairs")
    if todo:
        found = reranker.finish(prepared) if apart else reranker.score(query, texts)
        scores.update(zip(todo, found, strict=True))
    return blend_reranking(head, [scores[d] for d, _ in head], engine.settings.rerank_blend)


def passages(
    engine: HybridEngine,
    query: str,
    doc_ids: list[str],
    context: int,
    vector: np.ndarray | None = None,
    exclude: str | None = None,
    chunks: Mapping[str, Chunk] | None = None,
    inputs: PairInputs | None = None,
) -> tuple[list[str], list[PassageTokens] | None]:
    """The passages' texts and, with ``inputs``, their ids: each chunk's, after its memory context's."""
    known = dict(chunks or {})
    missing = [d for d in doc_ids if d not in known]
    if missing:
        known.update(engine.store.chunks(missing))
    bodies = [known[d] for d in doc_ids]
    texts = [chunk.contents for chunk in bodies]
    ids = inputs.passages(bodies) if inputs is not None else None
    if not context:
        return texts, None if ids is None else [PassageTokens(t, len(text)) for t, text in zip(ids, texts, strict=True)]
    if vector is None:
        vector = engine.dense.encode_query(query)
    cited = [engine.memory.cited_rows(vector, d, context, exclude) for d in doc_ids]
    prefixes = [engine.memory.cited_text(rows) for rows in cited]
    texts = [f"{prefix} {text}" for prefix, text in zip(prefixes, texts, strict=True)]
    if ids is None:
        return texts, None
    return texts, [
        PassageTokens(t, len(text), inputs.cited(rows), len(prefix) + 1)
        for t, text, rows, prefix in zip(ids, texts, cited, prefixes, strict=True)
    ]
