"""The dense index the engine chooses, at sizes past what one process holds as floats: 10M vectors.

    python -m benchmarks.scale --choice --sizes 10000000 --work /tmp/hs-scale

The vectors are :func:`benchmarks.scale.synthetic` (NFCorpus's own embeddings mixed), written a block
at a time into a ``.npy`` under ``--work`` and memory-mapped, as ``build --vectors`` reads a user's
file; the index is the one ``build`` makes (``index_build.dense_index.build_dense``, ``auto``), its
``nprobe`` tuned on the dev queries. Per size: the factory string, training and adding seconds, the
index's bytes, peak RSS, recall@100 against exact search and one-query-at-a-time p50/p95.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np

from offline.latency import percentiles

BLOCK = 500_000  # vectors generated and written at a time


def vectors_file(path: Path, base: np.ndarray, n: int) -> np.ndarray:
    """``n`` synthetic unit vectors in ``path`` (made once, then reused), memory-mapped."""
    from benchmarks.scale import synthetic

    if not path.is_file():
        partial = path.with_suffix(".partial.npy")
        out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(n, base.shape[1]))
        rng = np.random.default_rng(0)
        for start in range(0, n, BLOCK):
            out[start : start + BLOCK] = synthetic(base, min(BLOCK, n - start), rng)
        out.flush()
        del out
        partial.rename(path)
    return np.load(path, mmap_mode="r")


def measure(base: np.ndarray, queries: np.ndarray, n: int, work: Path) -> dict:
    import faiss

    from index_build.dense_index import build_dense

    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    vectors = vectors_file(work / f"vectors-{n}.npy", base, n)
    made_s = time.perf_counter() - started
    started = time.perf_counter()
    index, info = build_dense(vectors, "auto", progress=True, queries=lambda: queries)
    build_s = time.perf_counter() - started
    latencies = []
    for q in queries:
        began = time.perf_counter()
        index.search(q.reshape(1, -1), 100)
        latencies.append(time.perf_counter() - began)
    return {
        "vectors": n,
        "vectors_file_s": round(made_s, 1),
        "build_s": round(build_s, 1),
        **info,
        "index_bytes": int(faiss.serialize_index(index).size),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "query_ms": {k: v for k, v in percentiles(latencies).items() if k in ("p50", "p95", "p99")},
    }
