"""The order merged shards serve BM25 hits in."""

from __future__ import annotations

import numpy as np

from engine.retrieval.protocol import Ranking

TIE_STEPS = 4  # float32 steps within which two scores are one: shards are off by at most 3 (docs/ray.md)


def by_score_then_id(hits: Ranking) -> Ranking:
    """Best first, and a run of scores within :data:`TIE_STEPS` float32 steps of its best ordered by
    id, at that best score, as one Lucene index orders equal scores. A shard
    scores as one index only to float rounding (each term's weight rounded apart), so one index's
    equal scores (duplicates) can differ here in their last bits."""
    ordered: Ranking = []
    group: Ranking = []
    for hit in sorted(hits, key=lambda h: -h[1]):
        if group and group[0][1] - hit[1] > TIE_STEPS * np.spacing(np.float32(abs(group[0][1]))):
            ordered += _equal(group)
            group = []
        group.append(hit)
    return ordered + _equal(group)


def _equal(group: Ranking) -> Ranking:
    return [(unit, group[0][1]) for unit, _ in sorted(group)]
