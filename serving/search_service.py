"""The engine as every front door sees it: validated, asynchronous, time-limited and measured."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from agents.policy import PolicyError
from agents.router import left_running
from agents.settings import trace_db_for
from agents.solver import Solver, SolverRequest
from agents.system import build_responder, build_router
from agents.traces import TraceStore
from engine.documents import DocumentIn, FacetRequest, QueryRequest, SearchRequest
from engine.errors import ServiceError
from engine.health import FailureCount
from engine.live.writer import DocumentNotFound, snapshot_unwritten
from engine.rerank.cross_encoder import Scorer
from engine.search import Hit, HybridEngine, SearchOptions
from engine.search.opening import LOCAL, Remotes
from engine.store.snapshot import SnapshotRefused, default_folder, listing
from serving.admission import Admission, Overloaded
from serving.requests import BadRequest, validated
from serving.rerank_api import RerankRequest
from serving.settings import Settings

log = logging.getLogger(__name__)
REFRESH = ("wait_for", "true", "false")  # ?refresh= on writes: wait_for/true answer once searchable


@contextlib.asynccontextmanager
async def _held_by_caller() -> AsyncIterator[Callable[[asyncio.Future], None]]:
    yield left_running


class QueryTimeout(ServiceError, TimeoutError):
    """The query ran past the configured limit (504)."""

    status, jsonrpc_code = 504, -32001


class NoReranker(ServiceError, RuntimeError):
    """This server serves no reranker (none in the index, or --no-rerank): nothing to rerank with (503)."""

    status, jsonrpc_code = 503, -32007


class ReadOnly(ServiceError, PermissionError):
    """This server was started without writes (405: the method is not allowed here)."""

    status, jsonrpc_code = 405, -32006


class SearchService:
    """One loaded engine shared by all requests; CPU and GPU work runs off the event loop."""

    def __init__(
        self,
        settings: Settings,
        engine: HybridEngine | None = None,
        writable: bool = False,
        reranker: Scorer | None = None,
        remotes: Remotes = LOCAL,
    ) -> None:
        """``reranker``: in another process (by default the engine loads the index's own);
        ``remotes``: what else other processes serve (the index's writer, whose checkpoints this
        engine then shows; the query encoder)."""
        self.settings = settings
        self.search_request = SearchRequest.limited(settings.serving.max_query_chars)  # what a search may ask here
        # what search_nfcorpus takes: its arguments as the benchmark knows them, no controls
        self.query_request = QueryRequest.limited(settings.serving.max_query_chars)
        started = time.perf_counter()
        self._owns_engine = engine is None
        self.engine = engine or HybridEngine(settings.engine, writable, reranker, remotes)
        searches = settings.engine.warmup_searches if self._owns_engine else 0  # a lent engine is its owner's
        self.warmup = {"searches": searches, "seconds": round(self.engine.warm_up(searches), 2)}
        if searches:
            log.info("warmed Lucene with %d searches in %.1f s", searches, self.warmup["seconds"])
        traces = TraceStore(
            trace_db_for(settings.agents, settings.engine.index_dir),
            settings.agents.trace_max_age_days,
            settings.agents.trace_max_messages,
        )
        self.responder = responder = build_responder(self.engine, settings.agents, settings.serving.query_timeout_s)
        self.router = build_router(
            self.engine, traces, responder, settings.serving.query_timeout_s, search=self._admitted_search
        )
        self.solver = Solver(self.engine, responder, settings.serving.max_query_chars)
        self.load_seconds = time.perf_counter() - started
        # one thread for each request admission lets in: fewer, and admitted requests would queue
        # where admission cannot see them, spending their query timeout
        self._pool = ThreadPoolExecutor(max_workers=settings.serving.max_in_flight, thread_name_prefix="search")
        self.registry = CollectorRegistry()
        self.requests = Counter("search_requests", "Searches by front door", ["door"], registry=self.registry)
        self.errors = Counter("search_errors", "Failed searches by kind", ["door", "kind"], registry=self.registry)
        self.latency = Histogram(
            "search_stage_seconds",
            "Seconds per pipeline stage",
            ["stage"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.registry.register(_AgentMetrics(self.router))
        self.registry.register(_FallbackMetrics(self))
        self.registry.register(_RerankCacheMetrics(self.engine))
        self.registry.register(_RerankerChannelMetrics(self.engine))
        self.engine.stage_observers.append(self._observe)  # every search's stages, whoever asked
        self.admission = Admission(settings.serving.max_in_flight, settings.serving.max_queue_s, self.registry)

    async def search(self, request: QueryRequest, door: str, admitted: bool = False) -> list[Hit]:
        """A door's search: admitted, within the time limit, off the event loop; errors are counted
        and re-raised for the door to phrase (the search itself: :meth:`HybridEngine.search`).
        ``admitted``: the caller holds a slot already (a ``/v1`` message's door, whose slot then
        waits for this search's thread, past the time limit too). Controls this engine cannot
        honour are refused (422) before anything is counted or admitted."""
        options = self.engine.options_for(request)
        self.requests.labels(door).inc()
        loop = asyncio.get_running_loop()
        try:
            async with self._slot(door, admitted) as outlive:
                run = contextvars.copy_context().run  # the trace's context reaches the thread: stage spans
                future = loop.run_in_executor(self._pool, run, self._search, request, options, door)
                outlive(future)  # the slot is the thread's, past the time limit too
                return await asyncio.wait_for(asyncio.shield(future), timeout=self.settings.serving.query_timeout_s)
        except Overloaded:
            self.errors.labels(door, "overloaded").inc()
            raise
        except TimeoutError:
            self.errors.labels(door, "timeout").inc()
            raise QueryTimeout(f"query took longer than {self.settings.serving.query_timeout_s:g} s") from None
        except Exception:
            self.errors.labels(door, "internal").inc()
            raise

    async def _admitted_search(self, request: QueryRequest, door: str) -> list[Hit]:
        return await self.search(request, door, admitted=True)

    def _slot(self, door: str, admitted: bool):
        """An admission slot, or for a caller holding one already, its door's (see :func:`left_running`)."""
        return _held_by_caller() if admitted else self.admission.slot(door)

    def _search(self, request: QueryRequest, options: SearchOptions, door: str) -> list[Hit]:
        return self.engine.search(
            request.query, request.top_k, request.filters, request.similarity_threshold, options, door=door
        )

    def _observe(self, seconds: Mapping[str, float]) -> None:
        for stage, spent in seconds.items():
            self.latency.labels(stage).observe(spent)

    async def facets(self, request: FacetRequest, door: str) -> list[tuple[object, int]]:
        """Counts of a key's values (:meth:`HybridEngine.facets`), admitted and timed as a search is."""
        self.requests.labels(f"{door}-facets").inc()
        loop = asyncio.get_running_loop()
        try:
            async with self.admission.slot(door) as outlive:
                future = loop.run_in_executor(self._pool, self.engine.facets, request)
                outlive(future)
                return await asyncio.wait_for(asyncio.shield(future), timeout=self.settings.serving.query_timeout_s)
        except TimeoutError:
            self.errors.labels(door, "timeout").inc()
            raise QueryTimeout(f"counting took longer than {self.settings.serving.query_timeout_s:g} s") from None

    async def rerank(self, request: RerankRequest) -> list[float]:
        """A caller's own candidates scored by the served reranker (``POST /v1/rerank``), admitted and
        timed as a search is; on CUDA they join the searches' batches."""
        reranker = self.engine.reranker if self.engine.settings.rerank else None
        if reranker is None:
            raise NoReranker("this server serves no reranker (none in the index, or started with --no-rerank)")
        self.requests.labels("rerank").inc()
        loop = asyncio.get_running_loop()
        try:
            async with self.admission.slot("rerank") as outlive:
                future = loop.run_in_executor(self._pool, reranker.score, request.query, request.texts())
                outlive(future)
                return await asyncio.wait_for(asyncio.shield(future), timeout=self.settings.serving.query_timeout_s)
        except TimeoutError:
            self.errors.labels("rerank", "timeout").inc()
            raise QueryTimeout(f"reranking took longer than {self.settings.serving.query_timeout_s:g} s") from None

    async def solve(self, payload: object) -> dict:
        """A benchmark task (``SolverRequest``'s shape); BadRequest names the field or the rule."""
        request = validated(SolverRequest, payload)
        loop = asyncio.get_running_loop()
        self.requests.labels("solver").inc()
        try:
            async with self.admission.slot("solver") as outlive:
                run = contextvars.copy_context().run
                future = loop.run_in_executor(self._pool, run, self.solver.solve, request)
                outlive(future)  # as a search: the slot is the thread's, past the time limit too
                return await asyncio.wait_for(asyncio.shield(future), timeout=self.settings.serving.query_timeout_s)
        except PolicyError as exc:
            raise BadRequest(str(exc)) from None
        except TimeoutError:
            self.errors.labels("solver", "timeout").inc()
            raise QueryTimeout(f"task took longer than {self.settings.serving.query_timeout_s:g} s") from None

    # documents
    def _live(self):
        if self.engine.live is None:
            raise ReadOnly("this server serves a read-only index (started without writes)")
        return self.engine.live

    async def upsert(self, payload: object, wait: bool = False) -> dict:
        """Validate and log a document (DOCUMENT_INGESTION's shape); BadRequest names the field."""
        document = validated(DocumentIn, payload)
        live = self._live()
        async with self.admission.slot("documents"):
            return await asyncio.get_running_loop().run_in_executor(self._pool, live.upsert, document, wait)

    async def delete(self, document_id: str, wait: bool = False) -> dict:
        live = self._live()
        return await asyncio.get_running_loop().run_in_executor(self._pool, live.delete, document_id, wait)

    async def document(self, document_id: str) -> dict:
        engine = self.engine
        get = engine.live.document if engine.live is not None else engine.store.document
        found = await asyncio.get_running_loop().run_in_executor(self._pool, get, document_id)
        if found is None:
            raise DocumentNotFound(document_id)
        return found

    # snapshots
    @property
    def snapshots_dir(self) -> Path:
        """Where this server takes snapshots (``--snapshots-dir``, else beside the index)."""
        return self.settings.serving.snapshots_dir or default_folder(self.settings.engine.index_dir)

    async def snapshot(self) -> dict:
        """A snapshot of the served index at its last acknowledged write, in :attr:`snapshots_dir`,
        taken where the writes are: by the writer (in another process, for a follower), or, when no
        process writes the index, holding the writer's lock (:mod:`engine.store.snapshot`)."""
        engine = self.engine
        if engine.manifest.shards:
            raise SnapshotRefused(
                f"{self.settings.engine.index_dir}: a sharded index; snapshot each shard's folder (shards/<i>)"
                " with `hybrid-search snapshot create` when no server writes it"
            )
        if engine.live is not None:
            return await asyncio.to_thread(engine.live.snapshot, self.snapshots_dir)
        index_dir = self.settings.engine.index_dir
        return await asyncio.to_thread(snapshot_unwritten, index_dir, self.snapshots_dir, engine.bm25)

    def snapshots(self) -> list[dict]:
        """The snapshots in :attr:`snapshots_dir`, oldest first, as their manifests say (unverified)."""
        return listing(self.snapshots_dir)

    def exposition(self) -> bytes:
        """What ``/metrics`` answers: this process's series, in Prometheus' text format."""
        return generate_latest(self.registry)

    def fallbacks(self) -> dict[str, FailureCount]:
        """The stages a request falls back from when they fail (the reranker, an LLM server)."""
        found = {"reranker": self.engine.reranker_health} if self.engine.reranker is not None else {}
        health = getattr(self.responder, "health", None)  # an LLM server responder keeps one
        return found | ({"llm": health} if health is not None else {})

    def health(self) -> dict:
        """``status`` is ``degraded`` while a fallback serves (reranker or LLM failing) or live
        writes cannot be applied (a full disk, or the writer process is down): answers still come,
        not all of them as configured."""
        engine = self.engine
        fallbacks = {f"{name}_health": count.describe() for name, count in self.fallbacks().items()}
        failing = any(f["status"] == "failing" for f in fallbacks.values())
        live = engine.live.status() if engine.live is not None else None
        stuck = live is not None and (live.get("refresh_error") is not None or live.get("reachable") is False)
        topology = engine.index.status()
        shards = topology.get("shards")
        missing = [s["shard"] for s in shards or () if s.get("reachable") is False]
        return {
            "status": "degraded" if failing or stuck or missing else "ok",
            **fallbacks,
            "index_loaded": True,
            "index_dir": str(self.settings.engine.index_dir),
            # the chunks this engine's view holds: no count over the store
            "documents": len(engine.dense.units) if shards is None else sum(s.get("chunks", 0) for s in shards),
            **({"shards": shards, "missing_shards": missing} if shards is not None else {}),
            "writable": engine.live is not None,
            **({"live": live} if live is not None else {}),
            **({"follower": topology["follower"]} if "follower" in topology else {}),
            "device": engine.device,
            "encoder": engine.manifest.encoder,
            **engine.describe(),
            "dense_search": engine.dense.backend,
            "load_seconds": round(self.load_seconds, 2),
            "warmup": self.warmup,
        }

    def close(self) -> None:
        """Stop taking work and checkpoint the index (a writable one replays nothing at next start);
        an engine that was handed in stays open for its owner."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.router.traces.close()
        if self._owns_engine:
            self.engine.close()


class _FallbackMetrics:
    """``<stage>_failures_total``: how often the reranker or the LLM server failed (and a fallback
    answered), read at scrape time."""

    def __init__(self, service: SearchService) -> None:
        self.service = service

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for name, count in self.service.fallbacks().items():
            yield CounterMetricFamily(
                f"{name}_failures", f"Calls to the {name} that failed (a fallback answered)", value=count.failures
            )


class _RerankCacheMetrics:
    """``rerank_cache_hits_total`` / ``_misses_total``: (query, document) scores the cache answered."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        cache = getattr(self.engine.reranker, "cache", None)
        if cache is not None:
            yield CounterMetricFamily("rerank_cache_hits", "Reranker scores served from the cache", value=cache.hits)
            yield CounterMetricFamily("rerank_cache_misses", "Reranker scores computed", value=cache.misses)


class _RerankerChannelMetrics:
    """With the reranker in another process (``serve --workers N``, Ray): ``reranker_calls_total``,
    ``reranker_channel_bytes_total`` by direction, and ``reranker_process_seconds_total``, the calls'
    time inside that process; divided by the calls, a query's bytes and the reranker's own time."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        channel = getattr(self.engine.reranker, "channel", None)
        if channel is None:
            return
        counted = channel()
        if "calls" in counted:
            yield CounterMetricFamily("reranker_calls", "Calls to the reranker process", value=counted["calls"])
            sent = CounterMetricFamily("reranker_channel_bytes", "Bytes to and from the reranker", labels=["direction"])
            sent.add_metric(["sent"], counted["bytes_sent"])
            sent.add_metric(["received"], counted["bytes_received"])
            yield sent
        yield CounterMetricFamily(
            "reranker_process_seconds",
            "Seconds calls spent in the reranker's process",
            value=counted["process_seconds"],
        )


class _AgentMetrics:
    """Each protocol agent's health counters, read from the router at scrape time."""

    def __init__(self, router) -> None:
        self.router = router

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        processed = CounterMetricFamily("agent_messages", "Messages an agent answered", labels=["agent"])
        errors = CounterMetricFamily("agent_errors", "Messages an agent answered with an error", labels=["agent"])
        mean = GaugeMetricFamily("agent_response_ms_mean", "Mean milliseconds an agent took", labels=["agent"])
        for agent_id, stats in self.router.stats.items():
            processed.add_metric([agent_id], stats.processed)
            errors.add_metric([agent_id], stats.errors)
            mean.add_metric([agent_id], stats.total_ms / stats.processed if stats.processed else 0.0)
        yield from (processed, errors, mean)
