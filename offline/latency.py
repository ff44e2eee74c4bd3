"""Latency: percentiles, per pipeline stage in-process (``hybrid-search bench engine``), and the
report every latency run writes: ``<name>.json`` (with the machine description) and a PNG plot."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from engine.search import SearchOptions
from offline.records import write_result


def machine_name() -> str:
    """The results folder of this machine: its GPU's name, else ``cpu-<cores>core``."""
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        gpu = None
    return (gpu or f"cpu-{os.cpu_count()}core").replace(" ", "-").lower()


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = np.asarray(samples_s) * 1000
    return {
        "p50": float(np.percentile(ms, 50)),
        "p95": float(np.percentile(ms, 95)),
        "p99": float(np.percentile(ms, 99)),
        "mean": float(ms.mean()),
        "n": len(ms),
    }


def bench_engine(engine, queries: list[str], depths: list[int], concurrency: list[int], top_k: int = 5) -> dict:
    """Per-stage latency for each rerank depth (0 = no rerank), then QPS under concurrent load at
    the deepest depth swept; the engine is warmed first as a server warms it at start."""
    report: dict = {"device": engine.device, "queries": len(queries), "depths": {}}
    report["warmup_seconds"] = engine.warm_up(engine.settings.warmup_searches)
    for depth in depths:
        options = SearchOptions(rerank_depth=depth)
        engine.stages(queries[0], top_k, options=options)  # warm-up
        per_stage: dict[str, list[float]] = {}
        for query in queries:
            for stage, seconds in engine.stages(query, top_k, options=options).seconds.items():
                per_stage.setdefault(stage, []).append(seconds)
        report["depths"][depth] = {s: percentiles(v) for s, v in per_stage.items() if v}
    deepest = SearchOptions(rerank_depth=max(depths))
    report["concurrency_rerank_depth"] = max(depths)
    report["concurrency"] = {}
    for workers in concurrency:
        latencies: list[float] = []

        def one(query: str, latencies: list[float] = latencies) -> None:
            started = time.perf_counter()
            engine.search(query, top_k, options=deepest)
            latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, queries))
        wall = time.perf_counter() - started
        report["concurrency"][workers] = {"qps": len(queries) / wall, **percentiles(latencies)}
    report["rerank_budget"] = rerank_budget(report["depths"])
    return report


BUDGETS_MS = (10, 25, 50, 100, 250, 500, 1000)


def rerank_budget(depths: dict) -> dict:
    """What rerank depth each end-to-end latency budget allows: the deepest depth measured whose
    p95 fits, and the per-pair cost (least squares over the depths) to extrapolate from."""
    swept = sorted((int(d), stats) for d, stats in depths.items())
    ranked = [(d, stats["rerank"]["p50"]) for d, stats in swept if d > 0 and "rerank" in stats]
    per_pair = None
    if len(ranked) >= 2:
        xs, ys = np.array([d for d, _ in ranked], float), np.array([ms for _, ms in ranked], float)
        per_pair = float(np.polyfit(xs, ys, 1)[0])
    fits = {
        budget: max((d for d, stats in swept if stats["total"]["p95"] <= budget), default=None) for budget in BUDGETS_MS
    }
    return {"rerank_ms_per_pair": per_pair, "deepest_depth_within_p95_ms": fits}


def save(report: dict, name: str, out: Path, settings: dict | None = None) -> Path:
    """JSON (with its provenance) plus a plot in ``out``."""
    path = write_result(out / f"{name}.json", report, settings)
    _plot(report, out / f"{name}.png")
    return path


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if "depths" in report:
        depths = sorted(report["depths"], key=int)
        for stage in ("total", "rerank", "encode", "bm25", "dense"):
            ys = [report["depths"][d].get(stage, {}).get("p50") for d in depths]
            if any(y is not None for y in ys):
                ax.plot([int(d) for d in depths], [y or 0 for y in ys], marker="o", label=f"{stage} p50")
        ax.set_xlabel("rerank depth (0 = no reranking)")
        ax.set_title(f"per-stage latency, {report['device']}")
    else:
        runs = report["runs"]
        xs = [r["concurrency"] for r in runs]
        bodies = runs[0].get("bodies")  # bench rest --body: a line each
        lines = {f"{name} ": [r["bodies"][name] for r in runs] for name in bodies} if bodies else {"": runs}
        for name, stats in lines.items():
            ax.plot(xs, [s["p50"] for s in stats], marker="o", label=f"{name}p50")
            ax.plot(xs, [s["p95"] for s in stats], marker="o", label=f"{name}p95")
        ax.set_xlabel("concurrent clients")
        ax.set_title(f"{report['door']} end to end")
    ax.set_ylabel("ms")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
