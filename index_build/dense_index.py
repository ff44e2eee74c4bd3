"""The dense index a build makes, chosen for the corpus's size and shape and named as FAISS's
index_factory names an index, in one string.

``--dense-index``: ``auto`` (exact below :data:`IVF_FROM` vectors, IVF above, or HNSW where IVF
would probe too many lists), ``flat`` (exact inner product), ``hnsw`` (a graph), ``ivf`` (an
inverted file with 8-bit scalar codes, ``nlist`` from the size), or any index_factory string
(``IVF4096,PQ48``, ``IVF1024,Flat``...). An IVF index is trained on a sample, filled a batch at a
time, and its ``nprobe`` is the smallest that reaches :data:`TARGET_RECALL` recall@100 against
exact search on probe queries: the dataset's training queries or text-derived probes, encoded as
queries are (corpus vectors sit in their own lists and flatter it). ``auto`` keeps IVF only when
that nprobe is at most nlist / :data:`MOST_PROBED`: on a corpus whose vectors do not cluster, IVF
at half its lists costs what exact search does, and the build takes an HNSW graph instead (not flat:
``auto`` tries IVF only from the size where exact search is too slow), its recall measured on the
same probes; the manifest says what was chosen and why (``settings.dense.choice``).
Every index holds vectors by store row (flat and HNSW through ``IndexIDMap2``, IVF by its own ids),
so live writes can remove and replace single rows (on HNSW, removed rows are skipped until a merge
rebuilds the graph: :func:`engine.retrieval.segments.merged_base`).
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
# auto keeps IVF only when nprobe <= nlist / this: beyond, a query scans so much of the index that
# IVF's only gain over a graph is gone (docs/scale.md, "Corpora that do not cluster")
MOST_PROBED = 8
MOST_EF = 2048  # the widest efSearch tuned (a bound, not swept): a graph this wide still reads a small share
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
    probes: str = "",
    ef_search: int = 128,
) -> tuple[object, dict]:
    """The index over ``vectors`` (by ``rows``, default 0..n-1) and what the manifest records of it:
    the factory string, ``choice`` (what was chosen and why), and for an approximate index its
    recall@100 against exact search on ``queries()`` (encoded probe queries, asked for only when an
    approximate index is built; default: 200 corpus vectors, which flatter an inverted file),
    described by ``probes``. ``ef_search``: the HNSW breadth the engine searches with, widened
    until the graph reaches the target recall."""
    n = len(vectors)
    factory, key = resolve(kind, n, hnsw_m), f"recall_at_{min(RECALL_K, n)}"
    at = f"recall@{min(RECALL_K, n)}"
    why = f"--dense-index {kind}" if kind != "auto" else f"auto: {n:,} chunks, below {IVF_FROM:,}: exact search is fast"
    probing: dict = {}

    def probe_set() -> dict:
        if not probing:
            sample = queries() if queries is not None else _sample(vectors, RECALL_QUERIES)
            source = probes or (f"{len(sample)} corpus vectors" if queries is None else f"{len(sample)} queries")
            probing.update(queries=np.ascontiguousarray(sample, np.float32), source=source)
            probing["truth"] = _exact(vectors, probing["queries"], min(RECALL_K, n), rows)
        return probing

    index, info = _make(vectors, factory, hnsw_m, progress, rows)
    ivf = _ivf(index)
    if ivf is not None:
        info |= _tune_nprobe(index, ivf, probe_set())
        most = max(1, ivf.nlist // MOST_PROBED)
        if kind == "auto" and info["nprobe"] > most:
            tried = {k: info[k] for k in ("factory", "nlist", "nprobe", key, "train_seconds", "add_seconds")}
            why = (
                f"auto: {factory} needs nprobe {info['nprobe']:,} of {ivf.nlist:,} lists (more than 1/{MOST_PROBED})"
                f" for {at} {info[key]:.3f} on {probing['source']}: its vectors do not cluster, so a graph"
                f" (HNSW{hnsw_m}), not exact search, which is slow from {IVF_FROM:,} chunks"
            )
            del index
            factory = f"HNSW{hnsw_m}"
            index, info = _make(vectors, factory, hnsw_m, progress, rows)
            info["ivf_tried"] = tried
        elif kind == "auto":
            why = (
                f"auto: {n:,} chunks, and {factory} reaches {at} {info[key]:.3f} at nprobe {info['nprobe']:,}"
                f" of {ivf.nlist:,} lists on {probing['source']}"
            )
    if hasattr(_kind(index), "hnsw"):
        info |= _tune_ef(index, probe_set(), ef_search)
        if info[key] < TARGET_RECALL:
            log.warning("dense index %s: %s %.3f at efSearch %d, the most tried", factory, at, info[key], MOST_EF)
    if probing:
        info["probes"] = probing["source"]
    info["choice"] = {"chosen": factory, "why": why}
    log.info("dense index %s: %s", factory, why)
    return index, info


def _make(vectors: np.ndarray, factory: str, hnsw_m: int, progress: bool, rows: np.ndarray | None):
    """The index ``factory`` names, trained on a sample and filled, ids ``rows``; what it took."""
    import faiss

    from offline.progress import track

    n, dim = vectors.shape
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
    started = time.perf_counter()
    for start in track(
        starts, f"dense index {factory}: adding {n:,} vectors", "batch", enabled=progress and len(starts) > 1
    ):
        stop = min(n, start + step)
        ids = np.arange(start, stop) if rows is None else np.asarray(rows[start:stop], dtype=np.int64)
        index.add_with_ids(np.ascontiguousarray(vectors[start:stop], dtype=np.float32), ids)
    info["add_seconds"] = round(time.perf_counter() - started, 1)
    return index, info


def _ivf(index):
    import faiss

    return faiss.try_extract_index_ivf(index)


def _kind(index):
    import faiss

    return faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap2) else index


def _sample(vectors: np.ndarray, size: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    rows = np.sort(rng.choice(len(vectors), size=min(size, len(vectors)), replace=False))
    return np.ascontiguousarray(vectors[rows], dtype=np.float32)


def _exact(vectors: np.ndarray, queries: np.ndarray, k: int, ids: np.ndarray | None) -> np.ndarray:
    """Each query's exact top ``k`` ids (``ids``, default the positions), a block of vectors at a
    time: bounded memory."""
    import faiss

    exact = faiss.IndexFlatIP(vectors.shape[1])
    truth = np.full((len(queries), k), -1, dtype=np.int64)
    top = np.full((len(queries), k), -np.inf, dtype=np.float32)
    for start in range(0, len(vectors), 200_000):
        exact.reset()
        exact.add(np.ascontiguousarray(vectors[start : start + 200_000], dtype=np.float32))
        scores, rows = exact.search(queries, min(k, exact.ntotal))
        merged_scores = np.concatenate([top, scores], axis=1)
        merged_rows = np.concatenate([truth, rows + start], axis=1)
        best = np.argsort(-merged_scores, axis=1)[:, :k]
        top, truth = np.take_along_axis(merged_scores, best, 1), np.take_along_axis(merged_rows, best, 1)
    if ids is not None:
        truth = np.where(truth >= 0, np.asarray(ids, dtype=np.int64)[np.maximum(truth, 0)], -1)
    return truth


def _recall(index, probing: dict) -> float:
    truth = probing["truth"]
    _, found = index.search(probing["queries"], truth.shape[1])
    k = truth.shape[1]
    return float(np.mean([len(set(f) & set(t)) / k for f, t in zip(found, truth, strict=True)]))


def _tune_nprobe(index, ivf, probing: dict) -> dict:
    """The smallest power-of-two nprobe whose recall@100 against exact search reaches the target on
    the probes; set on the index."""
    recall, nprobe = 0.0, 1
    while True:
        ivf.nprobe = nprobe
        recall = _recall(index, probing)
        if recall >= TARGET_RECALL or nprobe >= ivf.nlist:
            break
        nprobe = min(ivf.nlist, nprobe * 2)
    k, count = probing["truth"].shape[1], len(probing["queries"])
    log.info("IVF nprobe %d: recall@%d %.3f against exact on %s", nprobe, k, recall, probing["source"])
    return {"nlist": ivf.nlist, "nprobe": nprobe, f"recall_at_{k}": round(recall, 4), "recall_queries": count}


def _tune_ef(index, probing: dict, ef_search: int) -> dict:
    """The smallest efSearch from the engine's (``--hnsw-ef-search``), doubling up to
    :data:`MOST_EF`, whose recall@100 against exact search reaches the target on the probes; set on
    the graph, so the index file carries it (a server searches with it, or its own if larger)."""
    graph, ef = _kind(index), ef_search
    while True:
        graph.hnsw.efSearch = ef
        recall = _recall(index, probing)
        if recall >= TARGET_RECALL or ef >= MOST_EF:
            break
        ef = min(MOST_EF, ef * 2)
    k, count = probing["truth"].shape[1], len(probing["queries"])
    log.info("HNSW efSearch %d: recall@%d %.3f against exact on %s", ef, k, recall, probing["source"])
    return {"ef_search": ef, f"recall_at_{k}": round(recall, 4), "recall_queries": count}
