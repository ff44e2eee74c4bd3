"""Dense search over shards: each shard's top ``k`` merged by score, equal scores by row, the
higher first, which is one exact index's order: rows are numbered across the corpus, and FAISS's
result heap orders equal inner products by id, the higher first (NFCorpus's duplicate abstracts
tie in 200 of its 324 dev queries' top 100; merged so, none of those rankings differs)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.documents import Filters
from engine.retrieval.protocol import Query, Ranking, Within
from engine.shards.fanout import Shard, Shards


class ShardedLive:
    """The chunks a sharded search may return (every shard's view, narrowed by ``filters``), asked
    of the shards for the few chunks a ranking holds: nothing corpus-sized at the coordinator."""

    rows = None  # no store rows here: each shard filters its own

    def __init__(self, shards: Shards, filters: Filters | None = None) -> None:
        self.shards, self.filters = shards, filters

    def contains(self, units: Sequence[str]) -> np.ndarray:
        held = np.zeros(len(units), dtype=bool)
        for answer in self.shards.ask(Shard.holding, list(units), self.filters):
            if answer is not None:
                held |= np.asarray(answer, dtype=bool)
        return held

    def __contains__(self, unit: object) -> bool:
        return isinstance(unit, str) and bool(self.contains([unit])[0])

    def __len__(self) -> int:
        return sum(n or 0 for n in self.shards.ask(Shard.size))


class ShardedDense:
    """The shards' dense indexes searched as one; queries encoded here, once, by ``query_encoder``."""

    def __init__(self, shards: Shards, encoder, query_encoder, backend: str) -> None:
        self.shards, self.encoder, self.query_encoder, self.backend = shards, encoder, query_encoder, backend
        self.units = ShardedLive(shards)

    def allowed(self, filters: Filters) -> ShardedLive:
        """What a search with ``filters`` may return: each shard answers for its own chunks."""
        return ShardedLive(self.shards, filters)

    def encode_query(self, query: str) -> np.ndarray:
        return self.query_encoder(query)

    def ranked(self, query: Query, k: int, filters: Filters | None) -> Ranking:
        hits = [hit for found in self.shards.ask(Shard.dense, query, k, filters) if found for hit in found]
        hits.sort(key=lambda hit: (-hit[1], -hit[2]))
        return [(unit, score) for unit, score, _ in hits[:k]]

    def retrieve(self, query: Query, k: int, within: Within) -> Ranking:
        return self.ranked(query, k, within.filters)

    def similarity(self, vector: np.ndarray, unit_ids: list[str]) -> list[float]:
        """Cosine of the query and each chunk, from the shard holding it (0 for one no shard holds
        now: written away since it was found)."""
        found: dict[str, float] = {}
        for answer in self.shards.ask(Shard.similarity, vector, unit_ids):
            found.update(answer or {})
        return [found.get(unit, 0.0) for unit in unit_ids]
