"""Issue 65's collection figures, each against real ``serve`` processes on NFCorpus copies:

* ``swap``: an alias swapped under ``--clients`` concurrent REST clients (aiohttp, one connection
  each): a steady run, a run during which ``docs`` moves from ``docs_v1`` to ``docs_v2`` and
  ``docs_v1`` is dropped while its searches still run, and a steady run after (the machine's
  own drift shows between the two steady runs). Counts failures, compares the swap run's p99 with
  the steady runs', and checks that every search started after the swap's reply answered from
  ``docs_v2`` (the ``X-Collection`` header names who answered).
* ``memory``: the resident and proportional memory (RSS, PSS) of a server of one collection, of a
  server of two (the second a copy of the first: same encoder, same reranker), and of a second
  server serving that copy alone, each after the same searches.
* ``mcp``: the official MCP client lists the collections and searches each; every dev query through
  ``search_nfcorpus`` of the default collection (an alias) and of today's ``--index-dir`` server: the
  same rankings, the same dev table.

    python -m benchmarks.collections [--parts swap,memory,mcp] [--searches 6000] [--clients 64]

Writes ``benchmarks/results/<machine>/collections.json`` (parts run on request are merged in).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from offline.dataset import load_dataset
from offline.evaluation import evaluate_run
from offline.latency import machine_name, percentiles
from offline.records import write_result
from offline.server_process import free_port, start_server, stop_server

PARTS = ("swap", "memory", "mcp")
INDEX = Path("indexes/nfcorpus")
DATA = Path("../shared/datasets/nfcorpus")
RERANKER = Path("../shared/models/nfcorpus-reranker-cpu")
SEARCH = "/search_nfcorpus"


def _copies(root: Path, names: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copytree(INDEX, root / name, ignore=shutil.ignore_patterns("reports"))
    return root


def _serve(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start_server(
        ["serve", *args, "--mcp-port", str(port), "--no-a2a", "--device", "cpu"],
        f"http://127.0.0.1:{port}/health",
        log,
        timeout_s=900,
    )
    return proc, f"http://127.0.0.1:{port}"


def _memory(pid: int) -> dict[str, float]:
    """RSS and PSS of the process, MiB (PSS shares each mapped page among the processes mapping it)."""
    found = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("Rss", "Pss"):
            found[key.lower() + "_mib"] = round(int(value.split()[0]) / 1024, 1)
    return found


# ---------------------------------------------------------------------------------------------- swap
async def _searches(base: str, path: str, queries: list[str], clients: int, total: int, records: list) -> None:
    """``total`` searches by ``clients`` concurrent clients, each kept as (started, seconds, status, answered by)."""
    import aiohttp

    counter = itertools.count()

    async def client(session) -> None:
        while (i := next(counter)) < total:
            started = time.perf_counter()
            try:
                async with session.post(base + path, json={"query": queries[i % len(queries)], "top_k": 10}) as reply:
                    await reply.read()
                    status, who = reply.status, reply.headers.get("x-collection")
            except Exception as exc:  # counted as a failure, named
                status, who = type(exc).__name__, None
            records.append((started, time.perf_counter() - started, status, who))

    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))


def _timeline(records: list, origin: float, width_s: float = 10.0) -> list[list[float]]:
    """[seconds from ``origin`` to the window's start, searches started in it, their p50 and p99 ms]:
    where in a run its slow searches were (the machine's other work shows as well as a swap)."""
    import numpy as np

    windows: dict[int, list[float]] = {}
    for started, seconds, status, _ in records:
        if status == 200:
            windows.setdefault(int((started - origin) // width_s), []).append(seconds * 1000)
    return [
        [w * width_s, len(ms), round(float(np.percentile(ms, 50))), round(float(np.percentile(ms, 99)))]
        for w, ms in sorted(windows.items())
    ]


def _summary(records: list) -> dict:
    failed = [r for r in records if r[2] != 200]
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[str(r[2])] = kinds.get(str(r[2]), 0) + 1
    latency = percentiles([r[1] for r in records if r[2] == 200] or [0.0])
    return {"searches": len(records), "failed": len(failed), "failures": kinds, "latency_ms": latency}


def swap(root: Path, queries: list[str], clients: int, searches: int) -> dict:
    """A steady run, the same load with the alias swapped (and the old collection dropped) once a
    third of its searches are done, and a steady run again."""
    folder = _copies(root / "swap", ["docs_v1", "docs_v2"])
    (folder / "aliases.json").write_text(json.dumps({"aliases": {"docs": "docs_v1"}}))
    log = root / "swap.log"
    # a wider queue than the default 2 s: 64 clients on 2 cores queue longer, and this counts the swap's failures
    proc, base = _serve(["--indexes", str(folder), "--no-rerank", "--max-queue", "30", "--query-timeout", "60"], log)
    path = f"/collections/docs{SEARCH}"
    try:
        for warm in ("docs_v1", "docs_v2"):  # both runs start warm, and so does the new index (as a deployment would)
            asyncio.run(_searches(base, f"/collections/{warm}{SEARCH}", queries, clients, 500, []))
        steady: list = []
        asyncio.run(_searches(base, path, queries, clients, searches, steady))
        during: list = []
        events: dict = {}

        async def swapped() -> None:
            while len(during) < searches // 3:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=base, timeout=60) as http:
                asked = time.perf_counter()
                reply = await http.put("/aliases/docs", json={"collection": "docs_v2"})
                events["acknowledged"] = time.perf_counter()
                events["swap_ms"] = round((events["acknowledged"] - asked) * 1000, 1)
                events["swap_reply"] = reply.json()
                dropped = await http.delete("/collections/docs_v1")
                events["drop_reply"] = dropped.json()
                dropped_at = time.perf_counter()
            while (folder / "docs_v1").exists() and time.perf_counter() - dropped_at < 120:
                await asyncio.sleep(0.01)
            events["old_closed_after_drop_s"] = round(time.perf_counter() - dropped_at, 2)
            events["old_folder_gone"] = not (folder / "docs_v1").exists()

        async def both() -> None:
            await asyncio.gather(_searches(base, path, queries, clients, searches, during), swapped())

        asyncio.run(both())
        listed = httpx.get(base + "/collections", timeout=60).json()
        steady_after: list = []
        asyncio.run(_searches(base, path, queries, clients, searches, steady_after))
    finally:
        stop_server(proc)
    ack = events["acknowledged"]
    after = [r for r in during if r[0] > ack]
    before = [r for r in during if r[0] + r[1] < ack]
    window = [r for r in during if abs(r[0] - ack) < 2.0 and r[2] == 200]
    steady_s, during_s, after_s = _summary(steady), _summary(during), _summary(steady_after)
    baseline = (steady_s["latency_ms"]["p99"] + after_s["latency_ms"]["p99"]) / 2
    return {
        "clients": clients,
        "steady": steady_s,
        "swap": during_s,
        "steady_after": after_s,
        "p99_ratio": round(during_s["latency_ms"]["p99"] / baseline, 3),  # against the two steady runs' mean
        "p99_ratio_to_steady_before": round(during_s["latency_ms"]["p99"] / steady_s["latency_ms"]["p99"], 3),
        "p99_ratio_to_steady_after": round(during_s["latency_ms"]["p99"] / after_s["latency_ms"]["p99"], 3),
        "swap_run_before_ack_latency_ms": percentiles([r[1] for r in before if r[2] == 200] or [0.0]),
        "swap_run_after_ack_latency_ms": percentiles([r[1] for r in after if r[2] == 200] or [0.0]),
        "within_2s_of_swap_latency_ms": percentiles([r[1] for r in window] or [0.0]),
        "started_after_ack": len(after),
        "started_after_ack_answered_by": sorted({str(r[3]) for r in after}),
        "every_later_search_from_new": all(r[3] == "docs_v2" for r in after) and bool(after),
        "finished_before_ack_answered_by": sorted({str(r[3]) for r in before}),
        "in_flight_at_ack": sum(1 for r in during if r[0] <= ack <= r[0] + r[1]),
        **{k: v for k, v in events.items() if k != "acknowledged"},
        "collections_after": [c["name"] for c in listed["collections"]],
        "failed_in_all_runs": steady_s["failed"] + during_s["failed"] + after_s["failed"],
        "timeline_10s": {  # [s from the run's start (the swap run's: from the swap's reply), n, p50, p99]
            "steady": _timeline(steady, min(r[0] for r in steady)),
            "swap": _timeline(during, ack),
            "steady_after": _timeline(steady_after, min(r[0] for r in steady_after)),
        },
        "server": "serve --indexes DIR --no-rerank --max-queue 30 --query-timeout 60 (two NFCorpus copies)",
    }


# -------------------------------------------------------------------------------------------- memory
def _warm(base: str, paths: list[str], queries: list[str], n: int) -> None:
    with httpx.Client(base_url=base, timeout=120) as http:
        for path in paths:
            for query in queries[:n]:
                http.post(path, json={"query": query, "top_k": 10}).raise_for_status()


def memory(root: Path, queries: list[str], warm: int) -> dict:
    """One collection; two in one server; the second in a server of its own: memory after ``warm`` searches each."""
    one = _copies(root / "one", ["docs_v1"])
    two = _copies(root / "two", ["docs_v1", "docs_v2"])
    alone = _copies(root / "alone", ["docs_v2"]) / "docs_v2"
    rerank = ["--reranker", str(RERANKER)] if RERANKER.is_dir() else []
    found = {}
    for label, args, paths in (
        ("one_collection", ["--indexes", str(one)], [f"/collections/docs_v1{SEARCH}"]),
        (
            "two_collections",
            ["--indexes", str(two)],
            [f"/collections/docs_v1{SEARCH}", f"/collections/docs_v2{SEARCH}"],
        ),
        ("second_server", ["--index-dir", str(alone)], [SEARCH]),
    ):
        proc, base = _serve([*args, *rerank], root / f"{label}.log")
        try:
            _warm(base, paths, queries, warm)
            found[label] = _memory(proc.pid)
            if label == "two_collections":
                found["models"] = httpx.get(base + "/collections", timeout=60).json()["models"]
        finally:
            stop_server(proc)
    second = {k: round(found["two_collections"][k] - found["one_collection"][k], 1) for k in ("rss_mib", "pss_mib")}
    return {
        **found,
        "second_collection_in_server": second,
        "second_server": found["second_server"],
        "share_of_a_second_server": round(second["rss_mib"] / found["second_server"]["rss_mib"], 3),
        "warm_searches_per_collection": warm,
        "reranker": str(RERANKER) if rerank else None,
    }


# ----------------------------------------------------------------------------------------------- mcp
async def _mcp(url: str, dev: dict[str, str], collections: bool) -> dict:
    from mcp import Client

    found: dict = {}
    async with Client(url + "/mcp") as client:
        if collections:
            listed = (await client.call_tool("list_collections", {})).structured_content
            found["listed"] = [
                {k: c[k] for k in ("name", "description", "documents", "status")} for c in listed["collections"]
            ]
            found["aliases"], found["default"] = listed["aliases"], listed["default"]
            found["searched"] = {}
            for c in listed["collections"]:
                reply = await client.call_tool("search", {"query": "vitamin D", "top_k": 3, "collection": c["name"]})
                found["searched"][c["name"]] = [r["document_id"] for r in reply.structured_content["results"]]
        run = {}
        for qid, query in dev.items():
            reply = await client.call_tool("search_nfcorpus", {"query": query, "top_k": 10})
            run[qid] = [r["doc_id"] for r in reply.structured_content["results"]]
        found["run"] = run
    return found


def mcp(root: Path, dataset) -> dict:
    """Today's server and a server of collections whose default (an alias) is the same index: the
    official client lists and searches each collection, then runs every dev query on both."""
    folder = _copies(root / "mcp", ["nfcorpus_v1", "other"])
    (folder / "aliases.json").write_text(json.dumps({"aliases": {"default": "nfcorpus_v1"}}))
    today = _copies(root / "today", ["nfcorpus"]) / "nfcorpus"
    rerank = ["--reranker", str(RERANKER)] if RERANKER.is_dir() else []
    dev = {q: dataset.queries[q] for q in dataset.qrels("dev")}
    runs = {}
    for label, args in (("today", ["--index-dir", str(today)]), ("collections", ["--indexes", str(folder)])):
        proc, base = _serve([*args, *rerank], root / f"mcp-{label}.log")
        try:
            runs[label] = asyncio.run(_mcp(base, dev, label == "collections"))
        finally:
            stop_server(proc)
    qrels = dataset.qrels("dev")
    tables = {label: evaluate_run(qrels, found["run"]) for label, found in runs.items()}
    served = runs["collections"]
    return {
        "listed": served["listed"],
        "aliases": served["aliases"],
        "default": served["default"],
        "searched_each": served["searched"],
        "dev_queries": len(dev),
        "dev_today": tables["today"],
        "dev_default_collection": tables["collections"],
        "rankings_identical": runs["today"]["run"] == served["run"],
        "reranker": str(RERANKER) if rerank else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--searches", type=int, default=6000, help="searches in each of the swap's two runs")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--warm", type=int, default=200, help="memory: searches per collection before measuring")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part {unknown[0]!r}; parts: {', '.join(PARTS)}")
    dataset = load_dataset(DATA)
    queries = list(dataset.queries.values())
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="collections-") as tmp:
        root = Path(tmp)
        if "swap" in parts:
            result["swap"] = swap(root, queries, args.clients, args.searches)
            print(json.dumps(result["swap"], indent=1)[:3000])
        if "memory" in parts:
            result["memory"] = memory(root, queries, args.warm)
            print(json.dumps(result["memory"], indent=1)[:3000])
        if "mcp" in parts:
            result["mcp"] = mcp(root, dataset)
            print(json.dumps({k: v for k, v in result["mcp"].items() if k != "listed"}, indent=1)[:3000])
    result["lscpu"] = subprocess.run("lscpu | head", shell=True, capture_output=True, text=True).stdout.splitlines()
    out = Path("benchmarks/results") / machine_name() / "collections.json"
    write_result(out, result, vars(args), update=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
