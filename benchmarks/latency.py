"""Latency benchmarks: per pipeline stage in-process, and end to end through the HTTP front doors.

Every run writes ``benchmarks/results/<machine>/<name>.json`` (with the machine description) and a
PNG plot beside it. Load generators are bounded in requests and time and talk only to the URL given.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

STAGES = ("bm25", "encode", "dense", "memory", "fusion", "rerank", "total")


def machine() -> dict:
    """What the numbers were measured on."""
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def machine_name() -> str:
    info = machine()
    return info.get("gpu", f"cpu-{info['cpus']}core").replace(" ", "-").lower()


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
    the deepest depth swept. The engine's reranker and depth are restored afterwards."""
    report: dict = {"machine": machine(), "device": engine.device, "queries": len(queries), "depths": {}}
    reranker, configured_depth = engine.reranker, engine.settings.rerank_depth

    def use_depth(depth: int) -> None:
        engine.reranker = reranker if depth > 0 else None
        engine.settings.rerank_depth = max(depth, 1)

    for depth in depths:
        use_depth(depth)
        engine.stages(queries[0], top_k)  # warm-up
        per_stage: dict[str, list[float]] = {s: [] for s in STAGES}
        for query in queries:
            for stage, seconds in engine.stages(query, top_k).seconds.items():
                per_stage[stage].append(seconds)
        report["depths"][depth] = {s: percentiles(v) for s, v in per_stage.items() if v}
    use_depth(max(depths))
    report["concurrency_rerank_depth"] = max(depths)
    report["concurrency"] = {}
    for workers in concurrency:
        latencies: list[float] = []

        def one(query: str, latencies: list[float] = latencies) -> None:
            started = time.perf_counter()
            engine.search(query, top_k)
            latencies.append(time.perf_counter() - started)

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, queries))
        wall = time.perf_counter() - started
        report["concurrency"][workers] = {"qps": len(queries) / wall, **percentiles(latencies)}
    engine.reranker, engine.settings.rerank_depth = reranker, configured_depth
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


async def _http_load(door: str, url: str, queries: list[str], concurrency: int, top_k: int, timeout: float) -> dict:
    import httpx

    latencies: list[float] = []
    errors = 0
    queue: asyncio.Queue[str] = asyncio.Queue()
    for query in queries:
        queue.put_nowait(query)

    async def worker(client: httpx.AsyncClient, session) -> None:
        nonlocal errors
        while not queue.empty():
            query = queue.get_nowait()
            started = time.perf_counter()
            try:
                await _one_request(door, url, client, session, query, top_k)
                latencies.append(time.perf_counter() - started)
            except Exception:
                errors += 1

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout) as client:
        if door == "mcp":
            from mcp import Client

            async with contextlib.AsyncExitStack() as stack:  # sessions close in reverse, as anyio requires
                opened = [await stack.enter_async_context(Client(url)) for _ in range(concurrency)]
                await asyncio.gather(*(worker(client, s) for s in opened))
        else:
            await asyncio.gather(*(worker(client, None) for _ in range(concurrency)))
    wall = time.perf_counter() - started
    return {
        "door": door,
        "concurrency": concurrency,
        "errors": errors,
        "qps": len(latencies) / wall,
        **percentiles(latencies or [0.0]),
    }


async def _one_request(door: str, url: str, client, session, query: str, top_k: int) -> None:
    if door == "rest":
        reply = await client.post(url, json={"query": query, "top_k": top_k})
        reply.raise_for_status()
        assert len(reply.json()["results"]) == top_k
    elif door == "mcp":
        result = await session.call_tool("search_nfcorpus", {"query": query, "top_k": top_k})
        assert not result.is_error
    elif door == "a2a":
        body = {
            "jsonrpc": "2.0",
            "id": uuid.uuid4().hex,
            "method": "message/send",
            "params": {
                "message": {
                    "role": "user",
                    "messageId": uuid.uuid4().hex,
                    "kind": "message",
                    "parts": [{"kind": "text", "text": json.dumps({"query": query, "top_k": top_k})}],
                }
            },
        }
        reply = await client.post(url, json=body)
        assert reply.json()["result"]["status"]["state"] == "completed"
    else:
        raise ValueError(f"unknown front door {door!r} (rest, mcp or a2a)")


def bench_http(
    door: str, url: str, queries: list[str], concurrency: list[int], top_k: int = 5, timeout: float = 60
) -> dict:
    """End-to-end latency through one front door at each concurrency level."""
    runs = [asyncio.run(_http_load(door, url, queries, c, top_k, timeout)) for c in concurrency]
    return {"machine": machine(), "door": door, "url": url, "queries": len(queries), "runs": runs}


def save(report: dict, name: str, out_dir: Path | None = None) -> Path:
    """JSON plus a plot, under ``benchmarks/results/<machine>/``."""
    out = out_dir or Path("benchmarks/results") / machine_name()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    _plot(report, out / f"{name}.png")
    return path


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if "depths" in report:
        depths = sorted(report["depths"], key=int)
        for stage in ("total", "rerank", "bm25", "encode", "dense"):
            ys = [report["depths"][d].get(stage, {}).get("p50") for d in depths]
            if any(y is not None for y in ys):
                ax.plot([int(d) for d in depths], [y or 0 for y in ys], marker="o", label=f"{stage} p50")
        ax.set_xlabel("rerank depth (0 = no reranking)")
        ax.set_title(f"per-stage latency, {report['device']}")
    else:
        xs = [r["concurrency"] for r in report["runs"]]
        ax.plot(xs, [r["p50"] for r in report["runs"]], marker="o", label="p50")
        ax.plot(xs, [r["p95"] for r in report["runs"]], marker="o", label="p95")
        ax.set_xlabel("concurrent clients")
        ax.set_title(f"{report['door']} end to end")
    ax.set_ylabel("ms")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
