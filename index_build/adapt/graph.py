"""The corpus graph: each chunk's nearest chunks by their vectors, found exactly or, past a size, by HNSW."""

from __future__ import annotations

import numpy as np

from engine.fusion.graph import CorpusGraph

EXACT_UP_TO = 50_000  # chunks whose graph is found by an exact scan; past it, by HNSW


def nearest(vectors: np.ndarray, k: int, exact_up_to: int = EXACT_UP_TO) -> tuple[np.ndarray, np.ndarray]:
    """Each vector's ``k`` nearest others by inner product (positions, best first) and their scores.
    Up to ``exact_up_to`` vectors exactly, by a FAISS flat scan (quadratic: ~10 s for 3,633 chunks on 2
    cores, hours for millions); past it by an HNSW graph of the vectors, whose build and searches grow
    as N log N, for a few neighbours missed."""
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    k = min(k, len(vectors) - 1)
    if len(vectors) <= exact_up_to:
        index = faiss.IndexFlatIP(vectors.shape[1])
    else:
        index = faiss.IndexHNSWFlat(vectors.shape[1], 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        index.hnsw.efSearch = max(64, 4 * k)
    index.add(vectors)
    scores, found = index.search(vectors, k + 1)
    keep = (found != np.arange(len(vectors))[:, None]) & (found >= 0)  # not itself, nor a slot HNSW left empty
    neighbours = np.stack([_first(row[mask], k) for row, mask in zip(found, keep, strict=True)])
    sims = np.stack([_first(row[mask], k) for row, mask in zip(scores, keep, strict=True)])
    return neighbours.astype(np.int64), sims.astype(np.float32)


def _first(values: np.ndarray, k: int) -> np.ndarray:
    """The first ``k`` of ``values``, zeros after them where there are fewer (a neighbour of weight 0)."""
    return np.concatenate([values[:k], np.zeros(max(0, k - len(values)), values.dtype)])


def served_graph(rows: np.ndarray, vectors: np.ndarray, k: int, weight: float) -> CorpusGraph:
    """The graph of the index as built (not the view), by store row: row r's neighbours' rows."""
    positions, sims = nearest(np.asarray(vectors, dtype=np.float32), k)
    size = int(rows.max()) + 1 if len(rows) else 0
    neighbours = np.full((size, k), -1, dtype=np.int64)
    similarities = np.zeros((size, k), dtype=np.float32)
    neighbours[rows] = rows[positions]
    similarities[rows] = sims
    return CorpusGraph(neighbours, similarities, weight)
