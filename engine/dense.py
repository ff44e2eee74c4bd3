"""Dense retrieval: a sentence-transformers encoder and a FAISS inner-product index.

Embeddings are L2-normalised, so inner product is cosine similarity. ``flat`` is exact and right
for corpora up to about a million documents on CPU; ``hnsw`` trades a little recall for
sub-linear search on larger ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def build_faiss(embeddings: np.ndarray, kind: str, hnsw_m: int = 32):
    """An index over ``embeddings`` (rows = documents in document-store order)."""
    import faiss

    dim = embeddings.shape[1]
    if kind == "flat":
        index = faiss.IndexFlatIP(dim)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 200
    else:
        raise ValueError(f"unknown dense index kind {kind!r} (flat or hnsw)")
    index.add(np.ascontiguousarray(embeddings, dtype=np.float32))
    return index


def encode(model, texts: list[str], batch_size: int = 64, progress: bool = False) -> np.ndarray:
    """Normalised float32 embeddings."""
    vectors = model.encode(
        texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=progress
    )
    return np.asarray(vectors, dtype=np.float32)


class DenseRetriever:
    """Encodes a query and searches the FAISS index; FAISS search is thread-safe for reads."""

    def __init__(self, faiss_path: str | Path, doc_ids: list[str], encoder, ef_search: int = 128) -> None:
        import faiss

        self._index = faiss.read_index(str(faiss_path))
        if self._index.ntotal != len(doc_ids):
            raise ValueError(f"{faiss_path}: {self._index.ntotal} vectors for {len(doc_ids)} documents")
        if hasattr(self._index, "hnsw"):
            self._index.hnsw.efSearch = ef_search
        self._doc_ids = doc_ids
        self.encoder = encoder

    def encode_query(self, query: str) -> np.ndarray:
        return encode(self.encoder, [query])

    def search(self, vector: np.ndarray, k: int) -> list[tuple[str, float]]:
        """Top ``k`` (doc id, cosine similarity) for an encoded query, best first."""
        scores, rows = self._index.search(vector, min(k, len(self._doc_ids)))
        return [(self._doc_ids[r], float(s)) for r, s in zip(rows[0], scores[0], strict=True) if r >= 0]
