"""Reciprocal rank fusion (Cormack et al., SIGIR 2009), with per-retriever weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def reciprocal_rank_fusion(
    rankings: Mapping[str, Sequence[str]], k: float = 60.0, weights: Mapping[str, float] | None = None
) -> list[tuple[str, float]]:
    """Fuse ranked id lists: score(d) = sum over retrievers r of w_r / (k + rank_r(d)), rank from 1.

    Ties are broken by the best single rank, then by id, so the order is deterministic. A retriever
    of weight 0 adds no candidate (its ranking is left out, not fused at score 0), so that the
    weights ``{"bm25": 1}`` and 0 for the others give exactly BM25's ranking.
    """
    weights = weights or {}
    scores: dict[str, float] = {}
    best_rank: dict[str, int] = {}
    for name, ranking in rankings.items():
        weight = weights.get(name, 1.0)
        if weight == 0:
            continue
        for rank, doc_id in enumerate(ranking, start=1):
            scores[doc_id] = scores.get(doc_id, 0.0) + weight / (k + rank)
            best_rank[doc_id] = min(best_rank.get(doc_id, rank), rank)
    order = sorted(scores, key=lambda d: (-scores[d], best_rank[d], d))
    return [(doc_id, scores[doc_id]) for doc_id in order]


def blend_reranking(
    head: Sequence[tuple[str, float]], scores: Sequence[float], blend: float
) -> list[tuple[str, float]]:
    """Order a ranking's head (``(id, first-stage score)``, best first) by the cross-encoder's ``scores``,
    softened by the first stage.

    ``blend`` 1 is the reranker's order with its scores; below 1 each document scores
    ``(1 - blend) * z(first stage) + blend * z(reranker)``, both standardised over the head (CombSUM
    of z-scores), which keeps what the first stage knows that a small reranker does not (on
    NFCorpus: the train-judgment memory) and lets each side's confidence count, not just its order.
    """
    if not head:  # a retriever that found nothing (BM25 on a query of stop words)
        return []
    if blend >= 1.0:
        ranked = sorted(range(len(head)), key=lambda i: (-scores[i], i))
        return [(head[i][0], float(scores[i])) for i in ranked]
    mixed = (1.0 - blend) * standardised([s for _, s in head]) + blend * standardised(scores)
    ranked = sorted(range(len(head)), key=lambda i: (-mixed[i], i))
    return [(head[i][0], float(mixed[i])) for i in ranked]


def standardised(values: Sequence[float]) -> np.ndarray:
    """``values`` as z-scores over themselves (all 0 when they do not differ)."""
    array = np.asarray(values, dtype=np.float64)
    spread = array.std()
    return (array - array.mean()) / spread if spread > 0 else np.zeros_like(array)
