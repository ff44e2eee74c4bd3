"""Retrieval quality: trec_eval measures through pytrec_eval, plus the benchmark evaluator's NDCG@5.

The NFCorpus green agent scores each returned list with ``sklearn.metrics.ndcg_score`` on the
grades of the returned documents only (the ideal ranking is those grades sorted), so a list of
unjudged documents scores 0 and a list scores 1 whenever its judged documents are in grade order.
It is not standard nDCG; both are reported, named apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from engine.search import AS_LOADED, SearchOptions
from offline.progress import track
from offline.records import write_result

Run = dict[str, list[str]]
Qrels = Mapping[str, Mapping[str, int]]

MEASURES = {"ndcg_cut_5": "nDCG@5", "ndcg_cut_10": "nDCG@10", "recall_100": "Recall@100"}


def in_list_ndcg(grades: Sequence[int], k: int = 5) -> float:
    """The evaluator's NDCG@k of one returned list, given the grade of each returned document."""
    from sklearn.metrics import ndcg_score

    if not grades:
        return 0.0
    if len(grades) == 1:  # sklearn refuses a single document; its ideal order is itself
        return 1.0 if grades[0] > 0 else 0.0
    predicted = list(range(len(grades), 0, -1))
    return float(ndcg_score([list(grades)], [predicted], k=k))


def sample_queries(queries: Mapping[str, str], n: int | None, seed: int) -> dict[str, str]:
    """``random.seed(seed); random.sample(queries, n)`` over (id, text) pairs in file order, as the
    benchmark's evaluator samples; ``n=None`` keeps them all."""
    import random

    items = list(queries.items())
    if n is None or n >= len(items):
        return dict(items)
    random.seed(seed)
    return dict(random.sample(items, n))


def evaluate_run(qrels: Qrels, run: Run) -> dict[str, float]:
    """Mean nDCG@5, nDCG@10, Recall@100, MRR@10 and in-list NDCG@5 over the judged queries in ``run``."""
    import pytrec_eval

    judged, as_scores = _judged(qrels, run)
    per_query = pytrec_eval.RelevanceEvaluator(judged, set(MEASURES)).evaluate(as_scores)
    top10 = {q: {d: s for d, s in docs.items() if s > len(docs) - 10} for q, docs in as_scores.items()}
    mrr = pytrec_eval.RelevanceEvaluator(judged, {"recip_rank"}).evaluate(top10)
    report = {label: _mean(per_query, m) for m, label in MEASURES.items()}
    report["MRR@10"] = _mean(mrr, "recip_rank")
    report["in-list NDCG@5"] = statistics.fmean(in_list_ndcg([judged[q].get(d, 0) for d in run[q][:5]]) for q in judged)
    report["queries"] = len(judged)
    return report


def paired_test(qrels: Qrels, run: Run, baseline: Run, measure: str = "ndcg_cut_10") -> dict[str, float]:
    """Mean per-query gain of ``run`` over ``baseline`` in a trec_eval ``measure`` and the two-sided
    p-value of a paired t-test over the judged queries of ``run`` (one the baseline lacks scores 0):
    is a difference more than noise?"""
    import pytrec_eval
    from scipy.stats import ttest_rel

    judged, as_scores = _judged(qrels, run)
    evaluator = pytrec_eval.RelevanceEvaluator(judged, {measure})
    ours, theirs = evaluator.evaluate(as_scores), evaluator.evaluate(_as_scores(baseline))
    a = [ours[q][measure] for q in judged]
    b = [theirs.get(q, {}).get(measure, 0.0) for q in judged]
    p_value = float(ttest_rel(a, b).pvalue) if a != b else 1.0
    return {"gain": statistics.fmean(a) - statistics.fmean(b), "p_value": p_value, "queries": len(a)}


def _judged(qrels: Qrels, run: Run) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, float]]]:
    """The judgments of the run's judged queries, and the run as descending scores for pytrec_eval."""
    judged = {q: dict(qrels[q]) for q in run if q in qrels}
    if not judged:
        raise ValueError("no query of the run has judgments")
    return judged, _as_scores({q: docs for q, docs in run.items() if q in judged})


def _as_scores(run: Run) -> dict[str, dict[str, float]]:
    return {q: {d: float(len(docs) - i) for i, d in enumerate(docs)} for q, docs in run.items()}


def _mean(per_query: dict[str, dict[str, float]], measure: str) -> float:
    return statistics.fmean(scores.get(measure, 0.0) for scores in per_query.values())


def write_trec_run(path: Path, run: Run, tag: str) -> None:
    """TREC run format: ``qid Q0 docid rank score tag``."""
    with open(path, "w") as fh:
        for qid, docs in run.items():
            for rank, doc_id in enumerate(docs, start=1):
                fh.write(f"{qid} Q0 {doc_id} {rank} {len(docs) - rank + 1} {tag}\n")


def read_trec_run(path: Path) -> Run:
    """A run :func:`write_trec_run` wrote, each query's documents by rank."""
    ranked: dict[str, list[tuple[int, str]]] = {}
    with open(path) as fh:
        for line in fh:
            qid, _, doc_id, rank, *_ = line.split()
            ranked.setdefault(qid, []).append((int(rank), doc_id))
    return {qid: [doc_id for _, doc_id in sorted(docs)] for qid, docs in ranked.items()}


def write_summary(path: Path, summary: dict) -> None:
    """An evaluation's summary, with the command, commit and machine that made it."""
    write_result(path, summary)


def stage_runs(
    engine,
    queries: Mapping[str, str],
    depth: int = 100,
    progress: bool = True,
    reranked: Sequence[str] = ("bm25", "dense", "rrf", "learned", "adapted"),
    options: SearchOptions = AS_LOADED,
) -> dict[str, Run]:
    """Each stage's ranking of every query: BM25, dense, judgment memory, RRF and, when the engine
    has one, the learned fusion or the adapted stage (``adapted``: RRF over the corpus graph); with a
    reranker, the ``reranked`` stages again with their heads reranked (``<stage>+rerank``).
    :func:`served_stage` names the fusion the engine serves.
    ``options``: another reranker or fusion to score with (a checkpoint being chosen).

    A reranked run continues past its head with the stage's own order, so Recall@100 compares like
    with like. The cross-encoder scores each (query, document) pair once across the heads.
    """

    runs: dict[str, Run] = {}
    for qid, text in track(queries.items(), "evaluating", "query", enabled=progress):
        result = engine.stages(text, top_k=1, options=options)
        present = {name: ranking for name, ranking in result.retrieved.items() if engine.retrievers()[name] is not None}
        rankings = {**present, "rrf": result.rrf}
        if result.fusion is not None:
            rankings["learned"] = result.fused
        elif engine.adapted is not None:
            rankings["adapted"] = result.fused
        for stage, ranking in rankings.items():
            ids = [d for d, _ in ranking[:depth]]
            runs.setdefault(stage, {})[qid] = ids
            if result.reranked is None or stage not in reranked:
                continue
            served = stage == served_stage(engine)
            head = (
                result.reranked
                if served
                else engine.rerank(text, ranking, result.rerank_scores, vector=result.query_vector, options=options)
            )
            runs.setdefault(f"{stage}+rerank", {})[qid] = continue_with_fused([d for d, _ in head], ids, depth)
    return runs


def served_stage(engine) -> str:
    """The stage name of the fusion ``engine`` serves: ``learned``, ``adapted`` or ``rrf``."""
    if engine.fusion is not None:
        return "learned"
    return "adapted" if engine.adapted is not None else "rrf"


def continue_with_fused(head: list[str], fused: list[str], depth: int = 100) -> list[str]:
    """A reranked head followed by the rest of the fused ranking, ``depth`` documents in all."""
    seen = set(head)
    return head + [d for d in fused if d not in seen][: depth - len(head)]
