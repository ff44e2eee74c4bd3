"""The dense index a build makes, chosen for the corpus's size and shape and named as FAISS's
index_factory names an index, in one string.

``--dense-index``: ``auto`` (exact below :data:`IVF_FROM` vectors, IVF above, or a refined scan or
HNSW where IVF would probe too many lists), ``flat`` (exact inner product), ``hnsw`` (a graph),
``ivf`` (an inverted file with 8-bit scalar codes, ``nlist`` from the size), ``scan`` (every
vector's 4-bit codes scanned, FAISS's fast-scan, and the best re-scored exactly), or any
index_factory string (``IVF4096,PQ48``, ``IVF1024,Flat``...). An IVF index is trained on a sample,
filled a batch at a time, and its ``nprobe`` is the smallest that reaches :data:`TARGET_RECALL`
recall@100 against exact search on probe queries: the dataset's training queries or text-derived
probes, encoded as queries are (corpus vectors sit in their own lists and flatter it); a graph's
``efSearch`` and a scan's re-scored share (``k_factor``) are tuned the same way. ``auto`` keeps
IVF only when that nprobe is at most nlist / :data:`MOST_PROBED`: on a corpus whose vectors do not
cluster, IVF at half its lists costs what exact search does. The build then takes the refined scan
up to :data:`SCAN_UNTIL` vectors (it builds in seconds and, while its codes stay in cache, searches
in a fraction of a graph's time), else an HNSW graph (not flat: ``auto`` tries IVF only from the
size where exact search is too slow), each with its recall measured on the same probes; the
manifest says what was chosen and why (``settings.dense.choice``).
Every index holds vectors by store row (flat, scan and HNSW through ``IndexIDMap2``, IVF by its own
ids), so live writes can remove and replace single rows (on HNSW and the scan, removed rows are
skipped until a merge builds them again: :func:`engine.retrieval.segments.merged_base`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

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
MOST_REFINED = 32  # the widest k_factor tuned: a scan re-scoring 3,200 of its best for a top 100
# auto's refined scan up to this many vectors, a graph beyond: once its codes outgrow the cache the
# scan runs at memory speed (12.5 ms a query at a million, where IVF at a quarter of its lists took
# 32), and a graph's walk grows more slowly (docs/scale.md, "Corpora that do not cluster")
SCAN_UNTIL = 1_500_000
NAMED = ("auto", "flat", "hnsw", "ivf", "scan")


def resolve(kind: str, n: int, hnsw_m: int = 32, dimension: int = 384) -> str:
    """The index_factory string ``kind`` means for ``n`` vectors of ``dimension``."""
    if kind == "auto":
        kind = "flat" if n < IVF_FROM else "ivf"
    if kind == "flat":
        return "Flat"
    if kind == "hnsw":
        return f"HNSW{hnsw_m}"
    if kind == "scan":  # two dimensions a 4-bit code (one where the dimension is odd), re-scored exactly
        return f"PQ{dimension // 2 if dimension % 2 == 0 else dimension}x4fs,RFlat"
    if kind == "ivf":
        nlist = max(1, min(65536, 2 ** round(math.log2(max(1.0, 4 * math.sqrt(n))))))
        return f"IVF{nlist},SQ8"
    return kind


def check_factory(kind: str, dimension: int, n: int) -> None:
    """Refuse, before any work, an index FAISS cannot make (with FAISS's reason), an inverted file
    with more lists than ``n`` vectors to train them, or product codes with more values than that."""
    import faiss

    factory = resolve(kind, n, dimension=dimension)
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
    coded = faiss.downcast_index(index.base_index) if isinstance(index, faiss.IndexRefine) else index
    codes = getattr(getattr(coded, "pq", None), "ksub", 0)  # a product quantizer trains this many codes a part
    if n < codes:
        raise ValueError(
            f"--dense-index {factory}: {n:,} chunks, fewer than the {codes} codes each part of a vector is trained"
            " to; use auto or flat until the corpus is larger"
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
    sought: Sequence[np.ndarray] | None = None,
) -> tuple[object, dict]:
    """The index over ``vectors`` (by ``rows``, default 0..n-1) and what the manifest records of it:
    the factory string, ``choice`` (what was chosen and why), and for an approximate index its
    recall@100 against exact search on ``queries()`` (encoded probe queries, asked for only when an
    approximate index is built; default: 200 corpus vectors, which flatter an inverted file),
    described by ``probes``. ``sought``: each probe's own answers (positions in ``vectors``: a
    training query's judged documents, a text probe's own chunk); of those exact search returns,
    the share the index returns must reach the target too, since a recall over all neighbours
    hides a sparse region's (docs/scale.md, "Like with like at a million"). ``ef_search``: the HNSW
    breadth the engine searches with, widened until the graph reaches the target recall."""
    n, dimension = vectors.shape
    factory, key = resolve(kind, n, hnsw_m, dimension), f"recall_at_{min(RECALL_K, n)}"
    why = f"--dense-index {kind}" if kind != "auto" else f"auto: {n:,} chunks, below {IVF_FROM:,}: exact search is fast"
    probing: dict = {}

    def probe_set() -> dict:
        if not probing:
            sample = queries() if queries is not None else _sample(vectors, RECALL_QUERIES)
            source = probes or (f"{len(sample)} corpus vectors" if queries is None else f"{len(sample)} queries")
            probing.update(queries=np.ascontiguousarray(sample, np.float32), source=source)
            probing["truth"] = _exact(vectors, probing["queries"], min(RECALL_K, n), rows)
            if sought is not None:  # what exact search finds of each probe's answers, by row
                ids = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, dtype=np.int64)
                probing["sought"] = [
                    set(ids[np.asarray(answers, dtype=np.int64)].tolist()) & set(exact.tolist())
                    for answers, exact in zip(sought, probing["truth"], strict=True)
                ]
        return probing

    def made(factory: str) -> tuple[object, dict]:
        """The index ``factory`` names, an approximate one's breadth tuned on the probes."""
        index, info = _make(vectors, factory, hnsw_m, progress, rows)
        ivf, kind_of = _ivf(index), _kind(index)
        if ivf is not None:
            info |= _widen(index, probe_set(), "nprobe", 1, ivf.nlist, lambda v: setattr(ivf, "nprobe", v))
        elif hasattr(kind_of, "hnsw"):
            graph = kind_of.hnsw
            info |= _widen(index, probe_set(), "ef_search", ef_search, MOST_EF, lambda v: setattr(graph, "efSearch", v))
        elif _refined(kind_of):
            info |= _widen(index, probe_set(), "k_factor", 1, MOST_REFINED, lambda v: setattr(kind_of, "k_factor", v))
        return index, info

    index, info = made(factory)
    ivf = _ivf(index)
    if kind == "auto" and ivf is not None and info["nprobe"] <= max(1, ivf.nlist // MOST_PROBED):
        why = (
            f"auto: {n:,} chunks, and {factory} reaches {_measured(info, n)[1]} at nprobe {info['nprobe']:,}"
            f" of {ivf.nlist:,} lists on {probing['source']}"
        )
    elif kind == "auto" and ivf is not None:
        tried = {k: v for k, v in info.items() if k in ("factory", "nlist", "nprobe", "train_seconds", "add_seconds")}
        tried |= {k: v for k, v in info.items() if k.endswith(key) or k == "sought"}
        crowded = (
            f"auto: {factory} needs nprobe {info['nprobe']:,} of {ivf.nlist:,} lists (more than 1/{MOST_PROBED})"
            f" for {_measured(info, n)[1]} on {probing['source']}: its lists do not hold the probes' neighbours"
        )
        del index, ivf
        index, info, instead = _instead_of_ivf(made, n, resolve("scan", n, hnsw_m, dimension), f"HNSW{hnsw_m}")
        why = f"{crowded}, so {instead}"
        info["ivf_tried"] = tried
    if _measured(info, n)[0] < TARGET_RECALL:
        log.warning("dense index %s: %s at its widest search", info["factory"], _measured(info, n)[1])
    if probing:
        info["probes"] = probing["source"]
    info["choice"] = {"chosen": info["factory"], "why": why}
    log.info("dense index %s: %s", info["factory"], why)
    return index, info


def _instead_of_ivf(made: Callable, n: int, scan: str, graph: str) -> tuple[object, dict, str]:
    """Where IVF would probe too much of itself: the refined ``scan`` up to :data:`SCAN_UNTIL` vectors
    when it reaches the target recall, else the ``graph``; with what was chosen and why."""
    if n > SCAN_UNTIL:
        because, tried = f"{n:,} chunks, more than a scan's {SCAN_UNTIL:,}", None
    else:
        index, info = made(scan)
        reached, measured = _measured(info, n)
        if reached >= TARGET_RECALL:
            return index, info, f"a scan of 4-bit codes re-scored exactly ({scan}, k_factor {info['k_factor']})"
        del index
        tried = {k: v for k, v in info.items() if k not in ("recall_queries", "probes")}
        because = f"{scan} reaches only {measured} at k_factor {info['k_factor']}"
    index, info = made(graph)
    if tried is not None:
        info["scan_tried"] = tried
    return index, info, f"a graph ({graph}: {because}), not exact search, which is slow from {IVF_FROM:,} chunks"


def _measured(info: dict, n: int) -> tuple[float, str]:
    """An index's recall against exact search, the lower of over all neighbours and of the answers
    sought (1.0 for an exact index), and as the manifest's reasons say it."""
    k = min(RECALL_K, n)
    recall, sought = info.get(f"recall_at_{k}", 1.0), info.get(f"sought_recall_at_{k}")
    if sought is None:
        return recall, f"recall@{k} {recall:.3f}"
    return min(recall, sought), f"recall@{k} {recall:.3f} ({sought:.3f} of the answers sought)"


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


def _recall(index, probing: dict) -> tuple[float, float | None]:
    """Recall@k against exact search, and of the probes' sought answers exact search returns, the
    share the index returns (None: none sought)."""
    truth = probing["truth"]
    _, found = index.search(probing["queries"], truth.shape[1])
    k = truth.shape[1]
    recall = float(np.mean([len(set(f) & set(t)) / k for f, t in zip(found, truth, strict=True)]))
    wanted = probing.get("sought")
    total = sum(len(w) for w in wanted) if wanted is not None else 0
    if not total:
        return recall, None
    return recall, sum(len(w & set(f.tolist())) for w, f in zip(wanted, found, strict=True)) / total


def _refined(index) -> bool:
    """Whether ``index`` re-scores a coarse search exactly (FAISS's ``IndexRefine``: the ``scan``)."""
    import faiss

    return isinstance(index, faiss.IndexRefine)


def _widen(index, probing: dict, name: str, start: int, most: int, set_to: Callable[[int], None]) -> dict:
    """The smallest breadth ``name`` (an IVF's nprobe, a graph's efSearch, a scan's k_factor) from
    ``start``, doubling up to ``most``, whose recall@100 against exact search reaches the target on
    the probes, of all their neighbours and of their answers sought; set on the index, so its file
    carries it (a server searches with it)."""
    breadth = start
    while True:
        set_to(breadth)
        recall, sought = _recall(index, probing)
        if min(recall, 1.0 if sought is None else sought) >= TARGET_RECALL or breadth >= most:
            break
        breadth = min(most, breadth * 2)
    k, count = probing["truth"].shape[1], len(probing["queries"])
    found = {name: breadth, f"recall_at_{k}": round(recall, 4), "recall_queries": count}
    if sought is not None:
        found |= {f"sought_recall_at_{k}": round(sought, 4), "sought": sum(len(w) for w in probing["sought"])}
    log.info("dense index: %s %d, %s against exact on %s", name, breadth, _measured(found, k)[1], probing["source"])
    ivf = _ivf(index)
    return found | ({"nlist": ivf.nlist} if ivf is not None else {})
