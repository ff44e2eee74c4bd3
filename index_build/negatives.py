"""Training candidates for the reranker, mined with the project's own retrievers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from offline.progress import track


@dataclass
class Mined:
    """Per training query: judged positives (id -> grade) and unjudged documents among its candidates."""

    positives: dict[str, dict[str, int]]
    negatives: dict[str, list[str]]


def mine_candidates(
    engine, queries: Mapping[str, str], qrels: Mapping[str, Mapping[str, int]], depth: int, progress: bool = True
) -> Mined:
    """Split each training query's RRF top ``depth`` into judged positives and hard negatives.

    The query is left out of the judgment memory, so its candidates are what the reranker would see
    for a new query; otherwise the memory returns the query's own labels and the "hard" negatives
    become whatever lexical matches are left. RRF rather than the learned fusion for the same
    reason: that was fitted on these very queries' judgments. Positives come from the same list, which is the
    decision reranking makes. Judged documents of any grade are never negatives: NFCorpus judges
    generously, so a judged 0 is rarer than an unjudged relevant one.
    """
    mined = Mined({}, {})
    for qid, text in track(queries.items(), "mining candidates", "query", enabled=progress):
        judged = qrels.get(qid, {})
        fused = [doc_id for doc_id, _ in engine.stages(text, top_k=depth, exclude=qid).rrf[:depth]]
        mined.positives[qid] = {d: judged[d] for d in fused if judged.get(d, 0) > 0}
        mined.negatives[qid] = [d for d in fused if d not in judged]
    return mined
