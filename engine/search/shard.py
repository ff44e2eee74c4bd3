"""One shard as a sharded search asks it: an engine over the shard's index directory, answering
the three phases of Elasticsearch's ``dfs_query_then_fetch`` and nothing more.

- **dfs:** :meth:`LocalShard.statistics`, the query's terms and how many of the shard's chunks hold
  each, with the shard's size, so that the coordinator scores BM25 with the whole corpus's;
- **query:** :meth:`LocalShard.bm25` and :meth:`LocalShard.dense`, the shard's top ``k`` inside its
  own view and its own answer to the filter;
- **fetch:** :meth:`LocalShard.chunks`, the texts of the hits merged.

Every argument and answer is plain data, so the same calls go to a shard in this process or to a
Ray deployment's replicas (``serving/ray_app.py: ShardReplica``), and a shard that follows its writer shows
the writer's checkpoints before it answers, as any follower does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine.documents import Filters
from engine.retrieval.protocol import Query, Ranking, Within
from engine.shards.bm25 import ShardStatistics, statistics_of
from engine.store.docstore import Chunk

if TYPE_CHECKING:
    from engine.search import HybridEngine


class QueriesComeEncoded:
    """A shard replica's encoders: none. Its queries arrive as vectors (encoded once, by whoever
    asks), and its writer, not it, encodes new documents; loading the models would only cost each
    replica their memory and its start."""

    runtime = "none: a shard's queries come encoded"

    def __call__(self, text: str) -> np.ndarray:
        raise RuntimeError("a shard replica encodes nothing: its queries come encoded")

    encode = __call__


ENCODED = QueriesComeEncoded()


class LocalShard:
    """A shard's engine (read-only, or following the shard's writer), asked by a sharded search."""

    def __init__(self, engine: HybridEngine) -> None:
        self.engine = engine

    def _within(self, filters: Filters | None) -> Within:
        engine = self.engine
        if filters is None or filters.empty:
            return Within(engine.dense.units)
        allowed = engine.allowed(filters)
        return Within(allowed, allowed, allowed.rows, filters)

    def _caught_up(self) -> None:
        if self.engine.follower is not None:
            self.engine.follower.catch_up()

    def statistics(self, text: str) -> ShardStatistics:
        self._caught_up()
        return statistics_of(self.engine.bm25, text)

    def bm25(
        self, query: Query, k: int, filters: Filters | None, weighted: list[tuple[str, float]], average: float
    ) -> Ranking:
        """The shard's top ``k`` by ``weighted`` terms, lengths normalised by ``average`` (the corpus's)."""
        self._caught_up()
        engine = self.engine
        with engine.view_lock.reading():
            return engine.bm25.retrieve(query, k, self._within(filters), weighted, average)

    def dense(self, query: Query, k: int, filters: Filters | None) -> list[tuple[str, float, int]]:
        """The shard's top ``k`` by the query's vector: (unit id, score, row)."""
        self._caught_up()
        engine = self.engine
        with engine.view_lock.reading():
            hits = engine.dense.retrieve(query, k, self._within(filters))
            rows = engine.dense.units.rows_of([unit for unit, _ in hits]).tolist()
        return [(unit, score, row) for (unit, score), row in zip(hits, rows, strict=True)]

    def chunks(self, unit_ids: Sequence[str]) -> dict[str, Chunk]:
        return self.engine.store.chunks(unit_ids)

    def similarity(self, vector: np.ndarray, unit_ids: Sequence[str]) -> dict[str, float]:
        """Cosine of the query and each of ``unit_ids`` this shard holds."""
        dense = self.engine.dense
        with self.engine.view_lock.reading():
            held = [unit for unit, kept in zip(unit_ids, dense.units.contains(unit_ids).tolist(), strict=True) if kept]
            return dict(zip(held, dense.similarity(vector, held), strict=True))

    def holding(self, unit_ids: Sequence[str], filters: Filters | None) -> list[bool]:
        """Which of ``unit_ids`` this shard may return (held, and passing ``filters``)."""
        with self.engine.view_lock.reading():
            return self._within(filters).live.contains(list(unit_ids)).tolist()

    def document(self, document_id: str) -> dict | None:
        live = self.engine.live
        return live.document(document_id) if live is not None else self.engine.store.document(document_id)

    def sample(self, n: int) -> list[Chunk]:
        return self.engine.store.sample(n)

    def size(self) -> int:
        """The chunks this shard's view holds."""
        return len(self.engine.dense.units)

    def close(self) -> None:
        self.engine.close()
