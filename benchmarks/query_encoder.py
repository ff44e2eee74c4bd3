"""Encoding one query: torch (sentence-transformers) against ONNX Runtime, on the dev queries.

    python -m benchmarks.query_encoder

Every dev query is encoded on both runtimes, and by the ONNX trace with int8 weights
(``--query-encoder-quantize int8``), and compared with torch (cosine; the minimum is what counts). Then
each runtime encodes the dev queries one at a time, from one thread and from two threads at once
(each all of them, as two concurrent requests would), in ``--rounds`` rounds that alternate the
runtimes; p50 / p95 ms a call and queries per second. Threads are set up as ``serve`` sets them.
``onnx, pool of 2`` is the same trace on a two-thread intra-op pool, which ``QUERY_THREADS``
(engine/onnx.py) declines, for comparison. The CPU's model and a matmul's GFLOP/s are in the
result's provenance.
"""

from __future__ import annotations

import argparse
import copy
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine import threads
from engine.onnx import OnnxQueryEncoder, open_session
from engine.retrieval.encoder import TorchQueryEncoder, load_encoder, load_query_encoder
from index_build.settings import BuildSettings
from offline.dataset import load_dataset
from offline.latency import machine_name, percentiles
from offline.records import write_result


def timed(encoder: Callable[[str], np.ndarray], queries: list[str], callers: int) -> tuple[list[float], float]:
    """Seconds of each call with ``callers`` threads each encoding every query, and the wall time."""
    samples: list[list[float]] = [[] for _ in range(callers)]
    start = threading.Barrier(callers + 1)

    def run(mine: list[float]) -> None:
        start.wait()
        for query in queries:
            t = time.perf_counter()
            encoder(query)
            mine.append(time.perf_counter() - t)

    threads = [threading.Thread(target=run, args=(s,)) for s in samples]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    return [x for s in samples for x in s], time.perf_counter() - began


def main() -> None:
    threads.for_queries()  # as `serve` runs: before torch loads
    import onnxruntime
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="dev")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    settings = BuildSettings()
    queries = list(load_dataset(settings.data_dir).split_queries(args.split).values())
    model = load_encoder(settings.encoder, "cpu")
    served = load_query_encoder(model, settings.encoder, "cpu", "onnx", "none")
    int8 = load_query_encoder(model, settings.encoder, "cpu", "onnx", "int8")
    assert isinstance(served, OnnxQueryEncoder) and isinstance(int8, OnnxQueryEncoder)
    pooled = copy.copy(served)
    pooled.session = open_session(served.path, "cpu", 2)
    runtimes = {"torch": TorchQueryEncoder(model), "onnx": served, "onnx, pool of 2": pooled, "onnx int8": int8}
    cosines = [float(served(q)[0] @ runtimes["torch"](q)[0]) for q in queries]
    cosines_int8 = [float(int8(q)[0] @ runtimes["torch"](q)[0]) for q in queries]
    load_before = os.getloadavg()[0]
    for encoder in runtimes.values():  # warm up: first calls allocate
        timed(encoder, queries[:20], 1)
    samples: dict[tuple[str, int], list[float]] = {}
    walls: dict[tuple[str, int], float] = {}
    for _ in range(args.rounds):
        for name, encoder in runtimes.items():
            for callers in (1, 2):
                got, wall = timed(encoder, queries, callers)
                samples.setdefault((name, callers), []).extend(got)
                walls[(name, callers)] = walls.get((name, callers), 0.0) + wall
    rows = []
    for (name, callers), got in samples.items():
        ms = percentiles(got)
        qps = len(got) / walls[(name, callers)]
        rows.append({"runtime": name, "callers": callers, "p50_ms": ms["p50"], "p95_ms": ms["p95"], "qps": qps})
        print(f"{name:16} {callers} caller(s): p50 {ms['p50']:6.2f} ms  p95 {ms['p95']:6.2f} ms  {qps:6.0f} queries/s")
    print(f"cosine to torch over {len(queries)} {args.split} queries: min {min(cosines):.7f}")
    print(f"the same with int8 weights: min {min(cosines_int8):.5f}")
    result = {
        "queries": len(queries),
        "cosine_min": min(cosines),
        "cosine_mean": float(np.mean(cosines)),
        "int8_cosine_min": min(cosines_int8),
        "int8_cosine_mean": float(np.mean(cosines_int8)),
        "rows": rows,
        "load_average_1min": [load_before, os.getloadavg()[0]],  # before and after: other work on the cores
        "torch_threads": torch.get_num_threads(),
        "onnxruntime": onnxruntime.__version__,
    }
    out = write_result(Path("benchmarks/results") / machine_name() / "query-encoder.json", result, vars(args))
    print(f"saved {out}")


if __name__ == "__main__":
    main()
