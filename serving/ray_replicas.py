"""The deployments of ``serve --ray`` that hold no door: the reranker, the writer, the page store
and a shard's replicas (:mod:`serving.ray_app` says what each does and holds the doors' ingress).

Apart from the doors' module so that their replica processes never import the doors (MCP, A2A,
the REST app): most of such a replica's start, past Ray's own, was that import.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from ray import serve
from ray.serve.handle import DeploymentHandle

from engine.live.writer import Writer
from engine.rerank.batching import score_rows
from engine.rerank.loading import open_reranker
from engine.rerank.token_rows import WireRows
from engine.search import HybridEngine
from engine.search.opening import Remotes, open_view
from engine.search.pages import PinFile, PinStore
from engine.search.shard import ENCODED, LocalShard
from engine.shards.fanout import Shard
from engine.shards.opened import shard_settings
from serving.remotes import DESCRIBED, RemoteWriter, RerankerCalls
from serving.settings import Settings
from serving.transport import RayTransport, served


class Replica:
    """A deployment's one entry, ``call(method, *args)``, answered from its ``calls`` (a Protocol's
    methods: :func:`~serving.transport.served`), as :class:`~serving.transport.RayTransport` sends
    them: the one Ray adapter, whatever the protocol. A blocking answer runs in a thread."""

    calls: dict[str, Callable[..., Any]]

    async def call(self, method: str, *args: Any) -> Any:
        answer = self.calls[method]
        if inspect.iscoroutinefunction(answer):
            return await answer(*args)
        return await asyncio.to_thread(answer, *args)


@serve.deployment(name="reranker")
class RerankerReplica(Replica):
    """The index's reranker as a deployment: the search replicas make the pairs (their score caches
    beside them) and send their token rows (:class:`serving.remotes.RemoteReranker`); concurrent
    queries' rows share one forward pass."""

    def __init__(self, settings: Settings, device: str) -> None:
        self.reranker = open_reranker(settings.engine, device, cache=False)  # the callers keep the score cache
        if self.reranker is None:
            raise RuntimeError(f"no reranker could be loaded from {settings.engine.reranker_path}")
        wait_ms = settings.scale_out.ray_batch_wait_ms
        if wait_ms is None:  # waiting pays only where a bigger batch costs little more (a GPU)
            wait_ms = settings.engine.rerank_batch_wait_ms if device == "cuda" else 0.0
        self._batched.set_max_batch_size(settings.scale_out.ray_batch_size)
        self._batched.set_batch_wait_timeout_s(wait_ms / 1000)
        self.calls = served(self, RerankerCalls)

    def describe(self) -> dict:
        return {key: getattr(self.reranker, key, None) for key in DESCRIBED}

    def status(self) -> dict:
        return {"deployment": "reranker", "device": self.reranker.device}

    async def score(self, wire: WireRows, lengths: np.ndarray) -> tuple[np.ndarray, float]:
        """A replica's rows scored, and the seconds it waited here (what :class:`RemoteReranker` counts)."""
        began = time.perf_counter()
        scores = await self._batched((wire, lengths))
        return np.asarray(scores, dtype=np.float32), time.perf_counter() - began

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0)
    async def _batched(self, calls: list[tuple[WireRows, np.ndarray]]) -> list[list[float]]:
        """One call per query, its rows and their lengths; Serve hands them over in batches."""
        return await asyncio.to_thread(score_rows, self.reranker, calls)


@serve.deployment(name="writer", num_replicas=1)
class WriterReplica(Replica):
    """The index's one writer: takes every replica's writes and publishes each refresh that applied
    some, which is what the search replicas follow (:mod:`engine.live.follower`)."""

    def __init__(self, settings: Settings) -> None:
        self.engine = HybridEngine(  # it encodes documents, never a query
            settings.engine.model_copy(update={"rerank": False, "followed": True}),
            True,
            remotes=Remotes(query_encoder=ENCODED),
        )
        self.calls = served(self.engine.live, Writer)

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()  # a checkpoint: the next writer replays nothing


@serve.deployment(name="pages", num_replicas=1)
class PagesReplica(Replica):
    """The rankings every search replica pins for its next pages (:mod:`engine.search.pages`), in
    one place, so that whichever replica Serve picks answers a page another pinned."""

    def __init__(self, settings: Settings) -> None:
        engine = settings.engine
        self.calls = served(PinFile(engine.page_pins, engine.page_pin_seconds), PinStore)


@serve.deployment(name="shard")
class ShardReplica(Replica):
    """One shard of a sharded index: its BM25, dense index and store, answering the coordinators'
    calls (:class:`engine.search.shard.LocalShard`), following its shard's writer when there is one."""

    def __init__(self, settings: Settings, shard: int, writer: DeploymentHandle | None) -> None:
        engine_settings = shard_settings(settings.engine, settings.engine.index_dir, shard)
        timeout = settings.serving.query_timeout_s
        follow = RemoteWriter(RayTransport(writer, f"writer of shard {shard}"), timeout) if writer else None
        role = "follower" if follow is not None else "reader"
        index = open_view(engine_settings, role, Remotes(writer=follow, encoder=ENCODED, query_encoder=ENCODED))
        index.warm_up(settings.engine.warmup_searches)  # the JVM compiles Lucene's search path before queries come
        self.shard = LocalShard(index)
        self.calls = served(self.shard, Shard)

    def __del__(self) -> None:
        shard = getattr(self, "shard", None)
        if shard is not None:
            shard.close()
