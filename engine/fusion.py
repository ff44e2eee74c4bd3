"""Reciprocal rank fusion (Cormack et al., SIGIR 2009), with per-retriever weights."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def reciprocal_rank_fusion(
    rankings: Mapping[str, Sequence[str]], k: float = 60.0, weights: Mapping[str, float] | None = None
) -> list[tuple[str, float]]:
    """Fuse ranked id lists: score(d) = sum over retrievers r of w_r / (k + rank_r(d)), rank from 1.

    Ties are broken by the best single rank, then by id, so the order is deterministic.
    """
    weights = weights or {}
    scores: dict[str, float] = {}
    best_rank: dict[str, int] = {}
    for name, ranking in rankings.items():
        weight = weights.get(name, 1.0)
        for rank, doc_id in enumerate(ranking, start=1):
            scores[doc_id] = scores.get(doc_id, 0.0) + weight / (k + rank)
            best_rank[doc_id] = min(best_rank.get(doc_id, rank), rank)
    order = sorted(scores, key=lambda d: (-scores[d], best_rank[d], d))
    return [(doc_id, scores[doc_id]) for doc_id in order]


def blend_reranking(
    head: Sequence[str], scores: Sequence[float], blend: float, k: float = 60.0
) -> list[tuple[str, float]]:
    """Order the fused head by the cross-encoder's ``scores``, softened by the fused order.

    ``blend`` 1 is the reranker's order with its scores; below 1 it is a weighted RRF of the two
    orders (reranker ``blend``, fusion ``1 - blend``), which keeps what fusion knows that a small
    reranker does not (on NFCorpus: the train-judgment memory).
    """
    ranked = sorted(range(len(head)), key=lambda i: (-scores[i], i))
    if blend >= 1.0:
        return [(head[i], float(scores[i])) for i in ranked]
    orders = {"fused": list(head), "rerank": [head[i] for i in ranked]}
    return reciprocal_rank_fusion(orders, k=k, weights={"fused": 1.0 - blend, "rerank": blend})
