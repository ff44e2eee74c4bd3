"""Hard negatives for reranker training, mined with the project's own retrievers."""

from __future__ import annotations

from collections.abc import Mapping

from tqdm import tqdm


def mine_hard_negatives(
    engine, queries: Mapping[str, str], qrels: Mapping[str, Mapping[str, int]], depth: int = 30, progress: bool = True
) -> dict[str, list[str]]:
    """Top fused BM25 + dense candidates of each query that carry no judgment at all.

    Judged documents of any grade are left out: NFCorpus judges generously, so a judged 0 is rarer
    than an unjudged relevant one, and a judged positive must never be trained as a negative.
    """
    mined: dict[str, list[str]] = {}
    for qid, text in tqdm(queries.items(), desc="mining negatives", unit="query", disable=not progress):
        judged = qrels.get(qid, {})
        fused = engine.stages(text, top_k=depth).fused
        mined[qid] = [doc_id for doc_id, _ in fused[:depth] if doc_id not in judged]
    return mined
