"""One shard as a sharded search asks it: the shard's index directory, opened, answering
the three phases of Elasticsearch's ``dfs_query_then_fetch`` and nothing more.

- **dfs:** :meth:`LocalShard.statistics`, the query's terms and how many of the shard's chunks hold
  each, with the shard's size, so that the coordinator scores BM25 with the whole corpus's;
- **query:** :meth:`LocalShard.bm25` and :meth:`LocalShard.dense`, the shard's top ``k`` inside its
  own view and its own answer to the filter;
- **fetch:** :meth:`LocalShard.chunks`, the texts of the hits merged.

Every argument and answer is plain data, so the same calls go to a shard in this process or to a
Ray deployment's replicas (``serving/ray_replicas.py: ShardReplica``), and a shard that follows its
writer shows the writer's checkpoints before it answers, as any follower does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from engine.documents import Filters
from engine.retrieval.protocol import Query, Ranking
from engine.shards.bm25 import ShardStatistics, statistics_of
from engine.store.docstore import Chunk

if TYPE_CHECKING:
    from engine.search.opening import OpenIndex


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
    """A shard's index (read-only, or following the shard's writer), asked by a sharded search."""

    def __init__(self, index: OpenIndex) -> None:
        self.index = index

    @property
    def backend(self) -> str:
        return self.index.view.dense.backend

    def _caught_up(self) -> None:
        self.index.catch_up()

    def statistics(self, text: str) -> ShardStatistics:
        self._caught_up()
        return statistics_of(self.index.view.bm25, text)

    def bm25(
        self, query: Query, k: int, filters: Filters | None, weighted: list[tuple[str, float]], average: float
    ) -> Ranking:
        """The shard's top ``k`` by ``weighted`` terms, lengths normalised by ``average`` (the corpus's)."""
        self._caught_up()
        index = self.index
        with index.lock.reading():
            return index.view.bm25.retrieve(query, k, index.within(filters), weighted, average)

    def dense(self, query: Query, k: int, filters: Filters | None) -> list[tuple[str, float, int]]:
        """The shard's top ``k`` by the query's vector: (unit id, score, row)."""
        self._caught_up()
        index = self.index
        with index.lock.reading():
            dense = index.view.dense
            hits = dense.retrieve(query, k, index.within(filters))
            rows = dense.units.rows_of([unit for unit, _ in hits]).tolist()
        return [(unit, score, row) for (unit, score), row in zip(hits, rows, strict=True)]

    def chunks(self, unit_ids: Sequence[str]) -> dict[str, Chunk]:
        return self.index.view.store.chunks(unit_ids)

    def similarity(self, vector: np.ndarray, unit_ids: Sequence[str]) -> dict[str, float]:
        """Cosine of the query and each of ``unit_ids`` this shard holds."""
        dense = self.index.view.dense
        with self.index.lock.reading():
            held = [unit for unit, kept in zip(unit_ids, dense.units.contains(unit_ids).tolist(), strict=True) if kept]
            return dict(zip(held, dense.similarity(vector, held), strict=True))

    def holding(self, unit_ids: Sequence[str], filters: Filters | None) -> list[bool]:
        """Which of ``unit_ids`` this shard may return (held, and passing ``filters``)."""
        with self.index.lock.reading():
            return self.index.within(filters).live.contains(list(unit_ids)).tolist()

    def document(self, document_id: str) -> dict | None:
        live = self.index.live
        return live.document(document_id) if live is not None else self.index.view.store.document(document_id)

    def sample(self, n: int) -> list[Chunk]:
        return self.index.view.store.sample(n)

    def size(self) -> int:
        """The chunks this shard's view holds."""
        return len(self.index.view.dense.units)

    def close(self) -> None:
        self.index.close()
