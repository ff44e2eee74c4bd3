"""Why a hit is where it is: every stage's rank and score for it, and how its final place was formed
(each retriever's share of the RRF score, the learned fusion's feature contributions, the rerank
blend). Built only for a request that asks (``"explain": true``), from what its stages returned."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from engine.fusion.rrf import standardised

if TYPE_CHECKING:
    from engine.search.results import StageResult


class RetrieverPart(BaseModel):
    rank: int | None = Field(description="its rank among this retriever's candidates, from 1; null: not among them")
    score: float | None = Field(description="this retriever's own score (BM25, cosine, votes); null: not found")
    depth: int = Field(description="candidates this retriever handed to fusion")
    weight: float = Field(description="the retriever's weight in RRF for this request (0: not fused)")
    contribution: float = Field(description="weight / (k + rank): what it added to the RRF score (0: not found)")


class FusionPart(BaseModel):
    method: Literal["rrf", "learned", "rrf + corpus graph"] = Field(description="what ordered the candidates")
    rank: int = Field(description="its rank after fusion, from 1")
    score: float = Field(description="its fused score (RRF's, or the learned model's or graph's)")
    k: float = Field(description="RRF's constant")
    rrf_rank: int = Field(description="its rank by RRF, the candidates every method starts from")
    rrf_score: float = Field(description="the sum of the retrievers' contributions")
    features: dict[str, float] | None = Field(None, description="learned: what the model read for this candidate")
    contributions: dict[str, float] | None = Field(
        None,
        description='learned, with "explain": "full": each feature\'s share of the score (SHAP values) and the'
        " model's bias; they sum to score",
    )


class RerankPart(BaseModel):
    score: float = Field(description="the cross-encoder's score for (query, passage)")
    head: int = Field(description="fused candidates reranked, this one among them")
    blend: float = Field(description="the reranker's share: final = (1 - blend) * fused_z + blend * reranker_z")
    fused_z: float = Field(description="its fused score as a z-score over the reranked head")
    reranker_z: float = Field(description="its cross-encoder score as a z-score over the head")


class FinalPart(BaseModel):
    rank: int = Field(description="where it is served, from 1")
    score: float = Field(description="the score served")
    by: Literal["rerank", "fusion"] = Field(description="which stage's order is served")


class Explanation(BaseModel):
    """One hit's path through the stages."""

    retrievers: dict[str, RetrieverPart]
    fusion: FusionPart
    rerank: RerankPart | None = Field(description="null: no reranking for this request (off, or the reranker failed)")
    final: FinalPart


def explain(result: StageResult, doc_ids: list[str], full: bool = False) -> list[Explanation]:
    """The explanation of each of ``doc_ids``, hits of ``result.ranked`` (in its order)."""
    plan = result.plan
    ranked = {name: _positions(ranking) for name, ranking in result.retrieved.items()}
    rrf, fused, final = _positions(result.rrf), _positions(result.fused), _positions(result.ranked)
    fusion = result.fusion  # full: TreeSHAP, ~1 ms a hit for 200 trees, 20x the rest of an explanation
    learned = fusion.explained(plan.query, result.retrieved, result.rrf, doc_ids, full) if fusion else None
    blend = _blend(result) if result.reranked is not None else {}
    explained = []
    for i, doc_id in enumerate(doc_ids):
        parts = {}
        for name, positions in ranked.items():
            rank, score = positions.get(doc_id, (None, None))
            weight = plan.weights[name]
            contribution = weight / (plan.rrf_k + rank) if rank is not None and weight else 0.0
            parts[name] = RetrieverPart(
                rank=rank, score=score, depth=plan.depths[name], weight=weight, contribution=contribution
            )
        rrf_rank, rrf_score = rrf[doc_id]
        fused_rank, fused_score = fused[doc_id]
        features, contributions = learned[i] if learned is not None else (None, None)
        fusion = FusionPart(
            method=plan.method,
            rank=fused_rank,
            score=fused_score,
            k=plan.rrf_k,
            rrf_rank=rrf_rank,
            rrf_score=rrf_score,
            features=features,
            contributions=contributions,
        )
        rank, score = final[doc_id]
        by = "rerank" if doc_id in blend else "fusion"
        final_part = FinalPart(rank=rank, score=score, by=by)
        explained.append(Explanation(retrievers=parts, fusion=fusion, rerank=blend.get(doc_id), final=final_part))
    return explained


def _positions(ranking) -> dict[str, tuple[int, float]]:
    return {doc_id: (rank, score) for rank, (doc_id, score) in enumerate(ranking, start=1)}


def _blend(result: StageResult) -> dict[str, RerankPart]:
    """Each reranked document's part: the head's fused and cross-encoder scores as z-scores, as
    :func:`engine.fusion.rrf.blend_reranking` mixed them."""
    head = result.fused[: len(result.reranked)]
    scores = [result.rerank_scores[d] for d, _ in head]
    fused_z, reranker_z = standardised([s for _, s in head]), standardised(scores)
    blend = result.plan.blend
    return {
        doc_id: RerankPart(score=score, head=len(head), blend=blend, fused_z=float(f), reranker_z=float(r))
        for (doc_id, _), score, f, r in zip(head, scores, fused_z, reranker_z, strict=True)
    }
