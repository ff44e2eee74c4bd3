"""BM25 over shards, each scored with the whole corpus's statistics: Elasticsearch's
``dfs_query_then_fetch`` through Lucene's public API.

A shard's BM25 differs from the whole index's only through its statistics: each term's idf
(chunks holding it over all chunks) and the average length in the length normalisation. Each shard
is searched with a similarity whose normalisation is the whole's (``LuceneIndex._lengths_matched``),
and each query term weighted ``boost * idf_whole / idf_shard``, from the shards' counts summed for
the query (one round of calls before the search). Scores then equal one index's to float rounding
(measured: docs/ray.md), and the merge orders them as one index does (:func:`by_score_then_id`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.documents import Filters
from engine.retrieval.lucene import LuceneIndex
from engine.retrieval.protocol import Query, Ranking, Within
from engine.shards.fanout import Shard, Shards
from engine.shards.merge import by_score_then_id


@dataclass(frozen=True)
class ShardStatistics:
    """A query's terms on one shard (with the generator's boosts), the chunks holding each, and the
    shard's chunks and their length in terms."""

    terms: list[tuple[str, float]]
    frequencies: list[int]
    documents: int
    length: int


def statistics_of(index: LuceneIndex, text: str) -> ShardStatistics:
    """What a shard says of ``text`` in the first round (its terms, their frequencies, its size)."""
    terms = index.query_terms(text)
    documents, length = index.collection()
    return ShardStatistics(terms, index.frequencies([t for t, _ in terms]), documents, length)


def idf(frequency: int, count: int) -> float:
    """Lucene's BM25 idf."""
    return math.log(1 + (count - frequency + 0.5) / (frequency + 0.5))


def weights(found: list[ShardStatistics | None]) -> tuple[list[list[tuple[str, float]] | None], float]:
    """Each shard's query terms weighted as the whole corpus weighs them (a term the shard holds
    nowhere: left out), and the corpus's average length; from every answering shard's statistics."""
    answered = [s for s in found if s is not None]
    documents = sum(s.documents for s in answered)
    average = sum(s.length for s in answered) / max(documents, 1)
    whole = [sum(column) for column in zip(*(s.frequencies for s in answered), strict=True)]
    weighted = [
        None
        if s is None
        else [
            (term, boost * idf(total, documents) / idf(own, s.documents))
            for (term, boost), own, total in zip(s.terms, s.frequencies, whole, strict=True)
            if own
        ]
        for s in found
    ]
    return weighted, average


class ShardedBM25:
    """:class:`~engine.retrieval.protocol.Retriever` over every shard's BM25, as one index."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards

    def scored(self, query: Query, k: int, filters: Filters | None) -> Ranking:
        """Every shard's top ``k``, scored as one index, not merged yet."""
        weighted, average = weights(self.shards.ask(Shard.statistics, query.text))
        asked = [None if not w else (query, k, filters, w, average) for w in weighted]
        return [hit for hits in self.shards.ask_each(Shard.bm25, asked) if hits for hit in hits]

    def ranked(self, query: Query, k: int, filters: Filters | None) -> Ranking:
        return by_score_then_id(self.scored(query, k, filters))[:k]

    def retrieve(self, query: Query, k: int, within: Within) -> Ranking:
        return self.ranked(query, k, within.filters)

    @property
    def documents(self) -> int:
        return sum(n or 0 for n in self.shards.ask(Shard.size))

    def close(self) -> None:
        """The shards close with :class:`ShardedStore`."""
