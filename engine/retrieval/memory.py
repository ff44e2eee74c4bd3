"""Judgment memory: retrieval learned from a corpus's training judgments.

Queries that resemble each other are answered by the same documents (NFCorpus queries are
NutritionFacts pages; their judgments link to the same PubMed abstracts). The memory keeps every
training query's embedding and judgments; a new query's ``neighbors`` most similar training
queries vote for their judged documents with weight ``similarity^2 * grade``. It is trained on
train judgments only, so dev and test queries never see their own labels.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from engine.retrieval.protocol import Query, Ranking, Within
from engine.store.tokens import TextTokenizer, TokenTable

log = logging.getLogger(__name__)
VECTORS_FILE = "queries.npy"
JUDGMENTS_FILE = "judgments.json"
TOKENS_FILE = "query_tokens.npz"  # the texts' token ids, for the tokenizer it names
# what a memory-aware reranker reads before a document: CITED, the texts joined by JOIN, then END
CITED, JOIN, END = "cited for: ", "; ", "."
NO_CITATION = "cited for: none."


def write_memory(
    folder: Path,
    vectors: np.ndarray,
    qrels: Mapping[str, Mapping[str, int]],
    query_ids: list[str],
    texts: list[str],
    tokenizer: TextTokenizer | None = None,
) -> None:
    """Rows of ``vectors`` are the normalised embeddings of ``query_ids`` (whose texts are ``texts``),
    in that order; ``tokenizer``: keep the texts' token ids too."""
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / VECTORS_FILE, vectors.astype(np.float32))
    judged = [{d: g for d, g in qrels[q].items() if g > 0} for q in query_ids]
    stored = {"query_ids": query_ids, "texts": texts, "judgments": judged}
    (folder / JUDGMENTS_FILE).write_text(json.dumps(stored))
    if tokenizer is not None:
        table = TokenTable.of(tokenizer(texts, kept=None), tokenizer.dtype)
        table.save(folder / TOKENS_FILE, fingerprint=np.array(tokenizer.fingerprint))


class JudgmentMemory:
    """Scores documents by the judgments of the most similar training queries."""

    def __init__(self, folder: str | Path, neighbors: int = 10) -> None:
        self.folder = Path(folder)
        self.vectors = np.load(self.folder / VECTORS_FILE)
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
        # each row's judgments as arrays over the judged documents sorted by id (a position's order
        # is the id's, which breaks ties): the votes are a weighted bincount, not a loop in Python
        self._docs = sorted(judged_by)
        position = {doc_id: i for i, doc_id in enumerate(self._docs)}
        self._voted = [np.array([position[d] for d in judged], dtype=np.int64) for judged in self.judgments]
        self._grades = [np.array(list(judged.values()), dtype=np.float64) for judged in self.judgments]

    def retrieve(self, query: Query, k: int, within: Within, neighbors: int | None = None) -> Ranking:
        """:class:`~engine.retrieval.protocol.Retriever`: the top ``k`` (doc id, vote) by the query's
        vector, best first, ties by doc id. Only documents ``within.live`` holds (the index's live
        documents, or a filter's) get votes, so a deleted document never returns here.

        ``query.exclude`` leaves one training query out, so features computed for a training query
        do not see its own judgments (used when learning on the training split). ``neighbors``: how
        many training queries vote (default: the memory's own).
        """
        vector, exclude, allowed = query.vector, query.exclude, within.live
        sims = self.vectors @ vector.reshape(-1)
        if exclude is not None and exclude in self._rows:
            sims[self._rows[exclude]] = -1.0
        n = min(neighbors or self.neighbors, len(sims))
        nearest = np.argpartition(-sims, n - 1)[:n]
        weights = np.maximum(sims[nearest].astype(np.float64), 0.0) ** 2
        # summed in the order of the nearest rows and of each row's judgments, as a loop would add them
        voted = np.concatenate([self._voted[row] for row in nearest])
        scores = np.concatenate([w * self._grades[row] for w, row in zip(weights, nearest, strict=True)])
        votes = np.bincount(voted, weights=scores, minlength=len(self._docs))
        found = np.flatnonzero(votes > 0)
        if allowed is not None:
            found = found[allowed.contains([self._docs[i] for i in found])] if len(found) else found
        best = found[np.lexsort((found, -votes[found]))][:k]  # by vote, ties by id
        return [(self._docs[i], float(votes[i])) for i in best]

    def cited_for(self, vector: np.ndarray, doc_id: str, n: int, exclude: str | None = None) -> str:
        """The training queries that judged ``doc_id`` relevant, the ``n`` most similar to ``vector``
        first, as a prefix for the document's text: what a memory-aware reranker reads, so that it
        can judge for itself whether those queries ask what this one asks. ``exclude`` leaves a
        training query out, as :meth:`retrieve` does."""
        return self.cited_text(self.cited_rows(vector, doc_id, n, exclude))

    def cited_rows(self, vector: np.ndarray, doc_id: str, n: int, exclude: str | None = None) -> np.ndarray:
        """The rows of the training queries :meth:`cited_for` names, in its order."""
        if self.texts is None:
            raise ValueError("this judgment memory keeps no query texts: rebuild the index with `hybrid-search build`")
        rows = self._judged_by.get(doc_id, np.empty(0, dtype=int))
        if exclude is not None and exclude in self._rows:
            rows = rows[rows != self._rows[exclude]]
        return rows[np.argsort(-(self.vectors[rows] @ vector.reshape(-1)), kind="stable")[:n]]

    def cited_text(self, rows: Sequence[int]) -> str:
        """The prefix :meth:`cited_for` gives for the training queries at ``rows``."""
        if not len(rows):
            return NO_CITATION
        return CITED + JOIN.join(self.texts[row] for row in rows) + END

    def query_tokens(self, tokenizer: TextTokenizer) -> list[np.ndarray]:
        """Each training query's token ids by ``tokenizer``: as the build kept them, else (another
        tokenizer, an index built before they were kept) computed now (queries are short)."""
        path = self.folder / TOKENS_FILE
        if path.is_file():
            table, arrays = TokenTable.load(path)
            if str(arrays["fingerprint"]) == tokenizer.fingerprint and len(table) == len(self.query_ids):
                return [table.ids[table.starts[i] : table.starts[i + 1]] for i in range(len(table))]
        log.info("tokenizing the memory's %d query texts for tokenizer %s", len(self.query_ids), tokenizer.fingerprint)
        return [t.ids for t in tokenizer(self.texts or [], kept=None)]


class CitedTokens:
    """The token ids of :meth:`JudgmentMemory.cited_text` without tokenizing it: each training
    query's ids between those of the fixed words. The same ids as the text's for a tokenizer that
    tokenizes each word alone (``TextTokenizer.by_words``): the pieces meet at a space or a
    punctuation mark, which ends a word."""

    def __init__(self, memory: JudgmentMemory, tokenizer: TextTokenizer) -> None:
        self.queries = memory.query_tokens(tokenizer)
        join = tokenizer.ids(JOIN)
        self.joined = [np.concatenate((ids, join)) for ids in self.queries]  # one array a query, not two
        self.cited, self.end, self.none = tokenizer.ids(CITED), tokenizer.ids(END), tokenizer.ids(NO_CITATION)

    def __call__(self, rows: Sequence[int]) -> np.ndarray:
        if not len(rows):
            return self.none
        return np.concatenate((self.cited, *(self.joined[row] for row in rows[:-1]), self.queries[rows[-1]], self.end))
