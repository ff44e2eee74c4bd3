"""The order merged shards serve hits in."""

from __future__ import annotations

from engine.retrieval.protocol import Ranking

TIE = 1e-6  # BM25 scores this close (relative) are equal: one index's duplicates, scored on two shards


def by_score_then_id(hits: Ranking) -> Ranking:
    """Best first, and a run of scores each within ``TIE`` of the one before ordered by id, as one
    Lucene index orders equal scores. Shards score as one index to float rounding (docs/ray.md), so
    equal scores there can differ here in the last bit; grouping them keeps one index's order."""
    ordered: Ranking = []
    group: Ranking = []
    for hit in sorted(hits, key=lambda h: -h[1]):
        if group and abs(group[-1][1] - hit[1]) > TIE * max(abs(hit[1]), 1e-9):
            ordered += _equal(group)
            group = []
        group.append(hit)
    return ordered + _equal(group)


def _equal(group: Ranking) -> Ranking:
    """A run of equal scores: by id, each the run's best (one index scores duplicates alike)."""
    return [(unit, group[0][1]) for unit, _ in sorted(group)]
