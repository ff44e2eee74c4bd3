"""Judgment memory: retrieval learned from a corpus's training judgments.

Queries that resemble each other are answered by the same documents (NFCorpus queries are
NutritionFacts pages; their judgments link to the same PubMed abstracts). The memory keeps every
training query's embedding and judgments; a new query's ``neighbors`` most similar training
queries vote for their judged documents with weight ``similarity^2 * grade``. It is trained on
train judgments only, so dev and test queries never see their own labels.
"""

from __future__ import annotations

import json
from collections.abc import Container, Mapping
from pathlib import Path

import numpy as np

VECTORS_FILE = "queries.npy"
JUDGMENTS_FILE = "judgments.json"


def write_memory(
    folder: Path,
    vectors: np.ndarray,
    qrels: Mapping[str, Mapping[str, int]],
    query_ids: list[str],
    texts: list[str],
) -> None:
    """Rows of ``vectors`` are the normalised embeddings of ``query_ids`` (whose texts are ``texts``),
    in that order."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / VECTORS_FILE, vectors.astype(np.float32))
    judged = [{d: g for d, g in qrels[q].items() if g > 0} for q in query_ids]
    stored = {"query_ids": query_ids, "texts": texts, "judgments": judged}
    (folder / JUDGMENTS_FILE).write_text(json.dumps(stored))


class JudgmentMemory:
    """Scores documents by the judgments of the most similar training queries."""

    def __init__(self, folder: str | Path, neighbors: int = 10) -> None:
        self.vectors = np.load(Path(folder) / VECTORS_FILE)
        stored = json.loads((Path(folder) / JUDGMENTS_FILE).read_text())
        self.query_ids: list[str] = stored["query_ids"]
        self.judgments: list[dict[str, int]] = stored["judgments"]
        if len(self.query_ids) != len(self.vectors):
            raise ValueError(f"{folder}: {len(self.vectors)} vectors for {len(self.query_ids)} queries")
        self.texts: list[str] | None = stored.get("texts")  # absent from older indexes
        self.neighbors = neighbors
        self._rows = {qid: row for row, qid in enumerate(self.query_ids)}
        judged_by: dict[str, list[int]] = {}
        for row, judged in enumerate(self.judgments):
            for doc_id in judged:
                judged_by.setdefault(doc_id, []).append(row)
        self._judged_by = {doc_id: np.array(rows) for doc_id, rows in judged_by.items()}

    def search(
        self,
        vector: np.ndarray,
        k: int,
        exclude: str | None = None,
        allowed: Container[str] | None = None,
        neighbors: int | None = None,
    ) -> list[tuple[str, float]]:
        """Top ``k`` (doc id, vote), best first; ties by doc id. Only documents in ``allowed`` (the
        index's live documents, or a filter's) get votes, so a deleted document never returns here.

        ``exclude`` leaves one training query out, so features computed for a training query do
        not see its own judgments (used when learning on the training split). ``neighbors``: how
        many training queries vote (default: the memory's own).
        """
        sims = self.vectors @ vector.reshape(-1)
        if exclude is not None and exclude in self._rows:
            sims[self._rows[exclude]] = -1.0
        n = min(neighbors or self.neighbors, len(sims))
        nearest = np.argpartition(-sims, n - 1)[:n]
        votes: dict[str, float] = {}
        for row in nearest:
            weight = float(max(sims[row], 0.0)) ** 2
            for doc_id, grade in self.judgments[row].items():
                if allowed is not None and doc_id not in allowed:
                    continue
                votes[doc_id] = votes.get(doc_id, 0.0) + weight * grade
        ranked = sorted(votes.items(), key=lambda item: (-item[1], item[0]))
        return [(d, s) for d, s in ranked[:k] if s > 0]

    def cited_for(self, vector: np.ndarray, doc_id: str, n: int, exclude: str | None = None) -> str:
        """The training queries that judged ``doc_id`` relevant, the ``n`` most similar to ``vector``
        first, as a prefix for the document's text: what a memory-aware reranker reads, so that it
        can judge for itself whether those queries ask what this one asks. ``exclude`` leaves a
        training query out, as :meth:`search` does."""
        if self.texts is None:
            raise ValueError("this judgment memory keeps no query texts: rebuild the index with `hybrid-search build`")
        rows = self._judged_by.get(doc_id, np.empty(0, dtype=int))
        if exclude is not None and exclude in self._rows:
            rows = rows[rows != self._rows[exclude]]
        if not len(rows):
            return "cited for: none."
        nearest = rows[np.argsort(-(self.vectors[rows] @ vector.reshape(-1)), kind="stable")[:n]]
        return "cited for: " + "; ".join(self.texts[row] for row in nearest) + "."
