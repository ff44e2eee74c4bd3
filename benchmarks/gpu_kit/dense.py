"""The kit's ``dense`` stage: the dense index on the GPU against the CPU index of the same recall.

At 3,633 documents the GPU packages add nothing measured, so the image leaves faiss-gpu out; at a
million chunks and more they may. Per size (1M and 10M vectors; a rehearsal's 20k and 200k): the
engine's GPU path (an exact matrix product in fp16 on torch, what ``place_index`` serves when
faiss-gpu is absent), faiss-gpu's exact and inverted-file indexes when the package is installed,
and the engine's own CPU choice (``--dense-index auto``: IVF with SQ8 codes, nprobe tuned to
recall@100 >= 0.95), each with its build seconds, p50/p99 ms for one query at a time and
recall@100 against fp32 exact search. The CPU index is built up to ``cpu_max`` vectors: at 10M its
training and adding take most of a lease.

The vectors are the kit's NFCorpus embeddings mixed (``benchmarks.scale.synthetic``), made a
million at a time; the queries are 200 more such mixes, never added.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from benchmarks.scale import synthetic
from engine.store.index_dir import DENSE_FILE
from offline.latency import percentiles
from offline.records import write_result

FULL = {"sizes": (1_000_000, 10_000_000), "cpu_max": 1_000_000}
SMALL = {"sizes": (20_000, 200_000), "cpu_max": 200_000}
QUERIES = 200
K = 100
BLOCK = 1_000_000


def dense(out: Path, small: bool) -> int:
    import faiss
    import torch

    scale = SMALL if small else FULL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpus = faiss.get_num_gpus() if hasattr(faiss, "StandardGpuResources") else 0
    stored = faiss.read_index(str(Path(os.environ["HYBRID_SEARCH_INDEX_DIR"]) / DENSE_FILE))
    base = faiss.downcast_index(stored.index if isinstance(stored, faiss.IndexIDMap2) else stored)
    base = base.reconstruct_n(0, base.ntotal)
    rng = np.random.default_rng(0)
    queries = synthetic(base, QUERIES, rng)
    report: dict = {"device": device, "faiss_gpus": gpus, "queries": QUERIES, "k": K, "sizes": []}
    for n in scale["sizes"]:
        vectors = np.concatenate([synthetic(base, min(BLOCK, n - s), rng) for s in range(0, n, BLOCK)])
        truth = _exact(vectors, queries, device)
        row: dict = {"n": n, "fp32_gb": round(vectors.nbytes / 2**30, 2), "indexes": {}}
        row["indexes"]["torch exact"] = _timed(lambda v=vectors: _torch_flat(v, device), queries, truth)
        if gpus:
            row["indexes"]["faiss-gpu flat"] = _timed(lambda v=vectors: _faiss_gpu(v, "Flat"), queries, truth)
            nlist = int(4 * np.sqrt(n))
            row["indexes"][f"faiss-gpu IVF{nlist},SQ8"] = _timed(
                lambda v=vectors, f=f"IVF{nlist},SQ8": _faiss_gpu(v, f), queries, truth
            )
        if n <= scale["cpu_max"]:
            row["indexes"]["faiss-cpu auto"] = _timed(lambda v=vectors: _engine_cpu(v, queries), queries, truth)
        report["sizes"].append(row)
        print(row, flush=True)
        write_result(out / "dense-gpu.json", report, {"small": small})
        del vectors
    return 0


def _exact(vectors: np.ndarray, queries: np.ndarray, device: str) -> np.ndarray:
    """Top ``K`` rows by fp32 inner product, a block at a time (bounded memory on either device)."""
    import torch

    q = torch.as_tensor(queries, device=device)
    best_scores = torch.full((len(queries), K), -torch.inf, device=device)
    best_rows = torch.zeros((len(queries), K), dtype=torch.int64, device=device)
    for start in range(0, len(vectors), BLOCK):
        block = torch.as_tensor(vectors[start : start + BLOCK], device=device)
        scores, rows = torch.topk(q @ block.T, min(K, len(block)), dim=1)
        merged = torch.cat([best_scores, scores], 1)
        keep = torch.topk(merged, K, dim=1).indices
        best_scores = torch.gather(merged, 1, keep)
        best_rows = torch.gather(torch.cat([best_rows, rows + start], 1), 1, keep)
    return best_rows.cpu().numpy()


def _timed(build, queries: np.ndarray, truth: np.ndarray) -> dict:
    started = time.perf_counter()
    index, info = build()
    found: dict = {"build_s": round(time.perf_counter() - started, 1), **info}
    rows, seconds = [], []
    for query in queries:
        begun = time.perf_counter()
        _, ids = index.search(query[None, :], K)
        seconds.append(time.perf_counter() - begun)
        rows.append(ids[0])
    found |= {f"{key}_ms": round(value, 3) for key, value in percentiles(seconds).items() if key in ("p50", "p99")}
    found[f"recall_at_{K}"] = round(
        float(np.mean([len(set(r) & set(t)) / K for r, t in zip(rows, truth, strict=True)])), 4
    )
    return found


def _torch_flat(vectors: np.ndarray, device: str):
    from engine.retrieval.dense import TorchFlatIndex

    return TorchFlatIndex(vectors, np.arange(len(vectors)), device), {}


def _faiss_gpu(vectors: np.ndarray, factory: str):
    import faiss

    index = faiss.index_factory(vectors.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    index = faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)
    if not index.is_trained:
        index.train(vectors[: 64 * int(4 * np.sqrt(len(vectors)))])
    index.add(vectors)
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.nprobe = 16
    return index, {"nprobe": 16} if ivf is not None else {}


def _engine_cpu(vectors: np.ndarray, queries: np.ndarray):
    from index_build.dense_index import build_dense

    return build_dense(vectors, "auto", queries=lambda: queries)
