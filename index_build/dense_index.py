"""The dense index a build makes, chosen for the corpus's size and named as FAISS's index_factory
names an index, in one string.

``--dense-index``: ``auto`` (exact below :data:`IVF_FROM` vectors, IVF above), ``flat`` (exact
inner product), ``hnsw`` (a graph: fast, takes no deletions, so no live writes), ``ivf`` (an
inverted file with 8-bit scalar codes, ``nlist`` from the size), or any index_factory string
(``IVF4096,PQ48``, ``IVF1024,Flat``...). An IVF index is trained on a sample, filled a batch at a
time, and its ``nprobe`` is the smallest that reaches :data:`TARGET_RECALL` recall@100 against
exact search on sample queries (corpus vectors); the recall measured is returned for the manifest.
Every index holds vectors by store row (flat and HNSW through ``IndexIDMap2``, IVF by its own ids),
so live writes can remove and replace single rows (flat and IVF; not HNSW).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)
# below this, exact search is fast enough, and exact (docs/configuration.md, "Why these defaults")
IVF_FROM = 200_000
TARGET_RECALL = 0.95
# k-means points a list: FAISS warns below 39; its default of 256 made training at 1M chunks take
# minutes for no measured recall (nprobe is tuned after it)
TRAIN_PER_LIST = 64
RECALL_QUERIES = 200
RECALL_K = 100
NAMED = ("auto", "flat", "hnsw", "ivf")


def resolve(kind: str, n: int, hnsw_m: int = 32) -> str:
    """The index_factory string ``kind`` means for ``n`` vectors."""
    if kind == "auto":
        kind = "flat" if n < IVF_FROM else "ivf"
    if kind == "flat":
        return "Flat"
    if kind == "hnsw":
        return f"HNSW{hnsw_m}"
    if kind == "ivf":
        nlist = max(1, min(65536, 2 ** round(math.log2(max(1.0, 4 * math.sqrt(n))))))
        return f"IVF{nlist},SQ8"
    return kind


def check_factory(kind: str, dimension: int, n: int) -> None:
    """Refuse, before any work, an index FAISS cannot make (with FAISS's reason) or an inverted file
    with more lists than ``n`` vectors to train them."""
    import faiss

    factory = resolve(kind, n)
    try:
        index = faiss.index_factory(dimension, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        cause = str(exc).strip().splitlines()[-1]
        raise ValueError(f"--dense-index {kind!r}: not an index FAISS can make ({cause})") from None
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None and n < ivf.nlist:
        raise ValueError(
            f"--dense-index {factory}: {n:,} chunks, fewer than its {ivf.nlist:,} lists; use auto or flat until the"
            " corpus is larger"
        )


def build_dense(
    vectors: np.ndarray,
    kind: str,
    hnsw_m: int = 32,
    progress: bool = False,
    queries: Callable[[], np.ndarray] | None = None,
    rows: np.ndarray | None = None,
) -> tuple[object, dict]:
    """The index over ``vectors`` (by ``rows``, default 0..n-1) and what the manifest records of it: the factory
    string, and for IVF its nlist, nprobe and recall@100 on ``queries()`` (encoded sample queries,
    asked for only then; default: corpus vectors, which sit in their own lists and flatter it)."""
    import faiss

    from offline.progress import track

    n, dim = vectors.shape
    factory = resolve(kind, n, hnsw_m)
    base = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    if hasattr(base, "hnsw"):
        base.hnsw.efConstruction = 200
    info: dict = {"factory": factory}
    ivf = faiss.try_extract_index_ivf(base)

    if not base.is_trained:
        sample = _sample(vectors, max(TRAIN_PER_LIST * (ivf.nlist if ivf is not None else 1), 50_000))
        log.info("dense index %s: training on %s of %s vectors", factory, f"{len(sample):,}", f"{n:,}")
        started = time.perf_counter()
        base.train(sample)
        info["train_seconds"] = round(time.perf_counter() - started, 1)
        log.info("dense index %s: trained in %.0f s", factory, info["train_seconds"])
    if ivf is not None:  # its own ids, and a hash map from them to read vectors back and remove them
        ivf.set_direct_map_type(faiss.DirectMap.Hashtable)
        index = base
    else:
        index = faiss.IndexIDMap2(base)
    step = 100_000
    starts = range(0, n, step)
    for start in track(
        starts, f"dense index {factory}: adding {n:,} vectors", "batch", enabled=progress and len(starts) > 1
    ):
        stop = min(n, start + step)
        ids = np.arange(start, stop) if rows is None else np.asarray(rows[start:stop], dtype=np.int64)
        index.add_with_ids(np.ascontiguousarray(vectors[start:stop], dtype=np.float32), ids)
    if ivf is not None:
        info |= {"nlist": ivf.nlist} | _tune_nprobe(index, ivf, vectors, queries() if queries else None, rows)
    return index, info


def _sample(vectors: np.ndarray, size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(len(vectors), size=min(size, len(vectors)), replace=False))
    return np.ascontiguousarray(vectors[rows], dtype=np.float32)


def _tune_nprobe(index, ivf, vectors: np.ndarray, queries: np.ndarray | None, ids: np.ndarray | None) -> dict:
    """The smallest power-of-two nprobe whose recall@100 against exact search reaches the target on
    ``queries``; set on the index (whose ids are ``ids``, default the positions)."""
    import faiss

    queries = _sample(vectors, RECALL_QUERIES) if queries is None else np.ascontiguousarray(queries, np.float32)
    k = min(RECALL_K, len(vectors))
    exact = faiss.IndexFlatIP(vectors.shape[1])
    truth = np.full((len(queries), k), -1, dtype=np.int64)
    top = np.full((len(queries), k), -np.inf, dtype=np.float32)
    for start in range(0, len(vectors), 200_000):  # exact search a block at a time: bounded memory
        exact.reset()
        exact.add(np.ascontiguousarray(vectors[start : start + 200_000], dtype=np.float32))
        scores, rows = exact.search(queries, min(k, exact.ntotal))
        merged_scores = np.concatenate([top, scores], axis=1)
        merged_rows = np.concatenate([truth, rows + start], axis=1)
        best = np.argsort(-merged_scores, axis=1)[:, :k]
        top, truth = np.take_along_axis(merged_scores, best, 1), np.take_along_axis(merged_rows, best, 1)
    if ids is not None:
        truth = np.where(truth >= 0, np.asarray(ids, dtype=np.int64)[np.maximum(truth, 0)], -1)
    recall, nprobe = 0.0, 1
    while True:
        ivf.nprobe = nprobe
        _, found = index.search(queries, k)
        recall = float(np.mean([len(set(f) & set(t)) / k for f, t in zip(found, truth, strict=True)]))
        if recall >= TARGET_RECALL or nprobe >= ivf.nlist:
            break
        nprobe = min(ivf.nlist, nprobe * 2)
    log.info("IVF nprobe %d: recall@%d %.3f against exact on %d sample queries", nprobe, k, recall, len(queries))
    return {"nprobe": nprobe, f"recall_at_{k}": round(recall, 4), "recall_queries": len(queries)}
