"""BM25 over a Lucene index, through pyserini (Anserini's analyzer and BM25, not a re-implementation)."""

from __future__ import annotations

import threading
from pathlib import Path

from engine.java import start_jvm


class BM25Retriever:
    """Ranks documents by Lucene BM25; one JVM-backed searcher shared by all threads."""

    def __init__(self, index_path: str | Path, k1: float = 0.9, b: float = 0.4) -> None:
        start_jvm()
        from pyserini.search.lucene import LuceneSearcher

        self._searcher = LuceneSearcher(str(index_path))
        self._searcher.set_bm25(k1=float(k1), b=float(b))
        self._lock = threading.Lock()

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        """Top ``k`` (doc id, BM25 score), best first."""
        with self._lock:
            hits = self._searcher.search(query, k=k)
        return [(hit.docid, float(hit.score)) for hit in hits]
