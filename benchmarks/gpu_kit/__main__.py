"""python -m benchmarks.gpu_kit plan | pack | run | check | http (see docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.gpu_kit.plan import BATCHES, KIT_DIR, LEASE_MINUTES, MANIFEST, REHEARSED, STAGES, describe, plan_minutes

HTTP_CLIENTS = (1, 64, 8)
# the new stages' sizes on the GPU, and in the CPU rehearsal (`rehearse`), which runs them small;
# "many": the load level asked at least "many_queries" times (the dev queries over again)
FULL = {"workers": "auto", "clients": HTTP_CLIENTS, "queries": None, "compiled_queries": 50, "many_queries": 1000}
SMALL = {"workers": "2", "clients": (1, 4), "queries": 40, "compiled_queries": 8, "many_queries": 80}


def check(out: Path) -> int:
    """What the stages ran on: GPU, driver, versions, and that Lucene, FAISS and the encoder load."""
    import importlib.metadata as md

    import torch

    from engine.search import HybridEngine
    from offline.records import write_result
    from serving.settings import Settings

    engine = HybridEngine(Settings().with_values(rerank=False).engine)  # the index the kit's environment names
    hits = engine.search("does vitamin D prevent falls?", 5)
    versions = {n: md.version(n) for n in ("torch", "transformers", "sentence-transformers", "faiss-cpu", "numpy")}
    report = {
        "cuda": torch.version.cuda,
        "capability": list(torch.cuda.get_device_capability(0)),
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "versions": versions,
        "dense_backend": engine.dense.backend,
        "smoke_search": [hit.doc_id for hit in hits],
        "install_seconds": float(Path("/tmp/gpukit/installed").read_text()),
    }
    print(json.dumps(report, indent=2))
    write_result(out, report)
    return 0


def _reranker() -> tuple[str, int | None]:
    """The index's reranker, or on a machine that trained none an untrained MiniLM cross-encoder:
    the served reranker's shape, at the window serving caps it to (``RERANK_MAX_LENGTH``), so the
    same compute (until 2026-11-28 the GPU recipe's 256 tokens, 2.8x the work a pair of what is served)."""
    index_reranker = Path(os.environ["HYBRID_SEARCH_INDEX_DIR"]) / "reranker"
    if index_reranker.is_dir():
        return str(index_reranker), None
    from engine.retrieval.encoder import DEFAULT_ENCODER, resolve_model

    return resolve_model(DEFAULT_ENCODER), None


def _reranker_args() -> list[str]:
    path, max_length = _reranker()
    return ["--reranker", path] + (["--max-length", str(max_length)] if max_length else [])


def _dev_queries(limit: int | None = None) -> list[str]:
    from offline.dataset import load_dataset

    return list(load_dataset(Path(os.environ["HYBRID_SEARCH_DATA_DIR"])).split_queries("dev").values())[:limit]


def http(out: Path) -> int:
    """``hybrid-search serve`` on the GPU, then REST and A2A end to end at 1, 8 and 64 clients."""
    from offline.door_load import bench_http
    from offline.latency import save
    from offline.server_process import free_port, start_server, stop_server

    queries = _dev_queries()
    rest, a2a = free_port(), free_port()
    args = ["serve", "--mcp-port", str(rest), "--a2a-port", str(a2a), *_reranker_args()]
    server = start_server(args, f"http://127.0.0.1:{rest}/health", out / "http-server.log")
    try:
        for door, url in (("rest", f"http://127.0.0.1:{rest}/search_nfcorpus"), ("a2a", f"http://127.0.0.1:{a2a}/")):
            bench_http(door, url, queries[:20], [1])  # warm-up: CUDA kernels, tokenizer, caches
            report = bench_http(door, url, queries, list(HTTP_CLIENTS))
            print(json.dumps(report["runs"]), flush=True)
            save(report, f"http-{door}", out)
    finally:
        print(f"server exit code {stop_server(server)}")
    return 0


SERVING = {  # stage -> (name of its results, one reranker process, serve's other flags)
    "shared": ("workers-shared-reranker", True, ()),  # the workers encode queries and search on the CPU
    "shared-gpu-encoder": ("workers-shared-reranker-gpu-encoder", True, ("--shared-query-encoder", "on")),
    "workers": ("workers-own-reranker", False, ()),
    # the host's ceiling, at the most clients only, its workers searching on the CPU as under the reranker process
    "no-rerank": ("workers-no-rerank", False, ("--no-rerank", "--retrieval-device", "cpu")),
}


CHANNEL = ("reranker_calls", "reranker_channel_bytes", "reranker_process_seconds")


def _stage_seconds(url: str) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """``/metrics``' per-stage histograms (every worker's): stage -> (seconds summed, count); and the
    channel to the reranker process: calls, bytes (both ways), seconds inside it."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[float]] = {}
    channel: dict[str, float] = dict.fromkeys(CHANNEL, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        if family.name in CHANNEL:
            channel[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total"))
        if family.name != "search_stage_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                found.setdefault(sample.labels["stage"], [0.0, 0.0])[sample.name.endswith("_count")] += sample.value
    return {stage: (total, count) for stage, (total, count) in found.items()}, channel


def serving(out: Path, stage: str, small: bool) -> int:
    """``serve --workers N`` end to end through REST at depth 100: each worker with its own reranker
    (``workers``), or every worker's pairs scored by the one reranker process (``shared``: the
    workers encode queries and search vectors on the CPU, so that the GPU has one owner; with
    ``shared-gpu-encoder`` that process also encodes every worker's queries, batched). Warmed with
    8 connections, then 1, 64 and 8 clients, each level saved as it ends with the served stages'
    mean ms (``/metrics``) and the reranker process's own time."""
    import httpx

    from offline.door_load import bench_http
    from offline.latency import save
    from offline.server_process import all_workers_up, free_port, start_server, stop_server

    scale = SMALL if small else FULL
    name, shared, flags = SERVING[stage]
    queries = _dev_queries(scale["queries"])
    many = queries * -(-scale["many_queries"] // len(queries))
    levels = (max(scale["clients"]),) if stage == "no-rerank" else scale["clients"]
    port = free_port()
    args = ["serve", "--mcp-port", str(port), "--no-a2a", "--workers", scale["workers"]]
    args += ["--shared-reranker", "on" if shared else "off", *_reranker_args(), "--rerank-depth", "100"]
    args += ["--rerank-cache-size", "0"]  # every query scored: the runs repeat the queries the warm-up asked
    args += flags
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    server = start_server(args, f"{url}/health", out / f"{name}-server.log")
    report: dict = {"workers": scale["workers"], "shared_reranker": shared, "flags": list(flags), "runs": []}
    try:
        report["workers_up"] = all_workers_up(url)
        report["start_s"] = round(time.perf_counter() - started, 1)
        bench_http("rest", f"{url}/search_nfcorpus", queries[:40], [8])  # warm-up: every worker, every bucket
        for clients in levels:
            (before, channel_before), process_before = _stage_seconds(url), _process(url)
            asked = many if clients == max(scale["clients"]) else queries
            run = bench_http("rest", f"{url}/search_nfcorpus", asked, [clients])["runs"][0]
            (after, channel_after), process_after = _stage_seconds(url), _process(url)
            calls = channel_after["reranker_calls"] - channel_before["reranker_calls"]
            if calls:  # a call a query: what one carried, and its time inside the reranker process
                run["channel_per_call"] = {
                    "bytes": round((channel_after["reranker_channel_bytes"] - channel_before["reranker_channel_bytes"]) / calls),
                    "process_ms": round(
                        1000 * (channel_after["reranker_process_seconds"] - channel_before["reranker_process_seconds"]) / calls, 2
                    ),
                }
            run["stage_ms_mean"] = {
                stage: round(1000 * (total - before.get(stage, (0, 0))[0]) / (count - before.get(stage, (0, 0))[1]), 2)
                for stage, (total, count) in after.items()
                if count > before.get(stage, (0, 0))[1]
            }
            if process_after:  # the model's own time in the same run, per query
                batches = process_after["batches"] - process_before["batches"]
                seconds = process_after["model_seconds"] - process_before["model_seconds"]
                pairs = process_after["pairs"] - process_before["pairs"]
                run["reranker_process"] = {
                    "batches": batches,
                    "pairs_per_batch": round(pairs / max(batches, 1), 1),
                    "model_ms_per_batch": round(1000 * seconds / max(batches, 1), 2),
                    "model_ms_per_query": round(1000 * seconds / max(len(asked), 1), 2),
                    "pairs_per_s_busy": round(pairs / max(seconds, 1e-9)),
                }
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
            health = httpx.get(f"{url}/health", timeout=30).json()
            keys = ("device", "reranker", "reranker_runtime", "reranker_plan", "rerank_depth", "retrieval_device")
            report |= {key: health.get(key) for key in keys} | {"reranker_process": health.get("reranker_process")}
            save(report | {"door": "rest", "queries": len(queries)}, name, out)  # each level kept as it ends
        if stage == "shared":  # the same reranker process for callers' own candidates: Cohere's /v1/rerank
            report["v1_rerank"] = _rerank_api(url, queries, scale)
            save(report | {"door": "rest", "queries": len(queries)}, name, out)
    finally:
        print(f"server exit code {stop_server(server)}")
    return 0


def _rerank_api(url: str, queries: list[str], scale: dict, clients: int = 16, documents: int = 100) -> dict:
    """``/v1/rerank`` at ``clients`` clients, each call a dev query and ``documents`` of the corpus:
    pairs a second through the door, beside the reranker process's own busy pairs a second."""
    from offline.dataset import load_dataset
    from offline.door_load import bench_http

    corpus = load_dataset(Path(os.environ["HYBRID_SEARCH_DATA_DIR"])).corpus.values()
    texts = [d.contents for _, d in zip(range(documents), corpus)]
    before = _process(url)
    run = bench_http("rerank", f"{url}/v1/rerank", queries, [clients], documents=texts)["runs"][0]
    after = _process(url)
    run["pairs_per_s"] = round(run["qps"] * documents)
    if before and after:
        seconds = after["model_seconds"] - before["model_seconds"]
        run["reranker_process_pairs_per_s_busy"] = round((after["pairs"] - before["pairs"]) / max(seconds, 1e-9))
    print(json.dumps({"v1_rerank": run}), flush=True)
    return run


def _process(url: str) -> dict | None:
    """The reranker process's counters, as ``/health`` shows them (None: no such process)."""
    import httpx

    process = httpx.get(f"{url}/health", timeout=30).json().get("reranker_process")
    return process if process and process.get("reachable") else None


def compiled(out: Path, small: bool) -> int:
    """The served reranker (torch) eager and compiled over its buckets, each loaded with the same
    seed (an untrained head is random): ms for one query's pairs, the model apart from making its
    pairs, the compile's seconds and graphs per bucket, recompiles while timing, and rank agreement."""
    import numpy as np
    import torch
    from torch._dynamo.utils import counters

    from benchmarks.gpu_rerank import _pairs, _spearman
    from engine.rerank.cross_encoder import Reranker
    from engine.settings import EngineSettings
    from offline.records import write_result

    scale = SMALL if small else FULL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path, max_length = _reranker()
    settings = EngineSettings()
    per_query = _pairs(scale["compiled_queries"], 100)
    report: dict = {"device": device, "reranker": path, "queries": len(per_query), "depth": 100, "variants": {}}
    reference: list[np.ndarray] = []
    for variant, compile_model in (("eager", False), ("compiled", True)):
        torch.manual_seed(0)
        started = time.perf_counter()
        batch = settings.rerank_batch_for(device)
        reranker = Reranker(path, device, max_length, batch, "torch", "none", compile_model=compile_model)
        loaded = time.perf_counter() - started
        reranker.score_pairs(per_query[0][1])
        graphs = counters["stats"]["unique_graphs"]
        prepare_s, model_s, scores = [], [], []
        for query, pairs in per_query:
            began = time.perf_counter()
            prepared = reranker.prepare(query, [p for _, p in pairs])
            made = time.perf_counter()
            scores.append(np.array(reranker.finish(prepared)))
            prepare_s.append(made - began)
            model_s.append(time.perf_counter() - made)
        reference = reference or scores
        rho = [_spearman(r, g) for r, g in zip(reference, scores, strict=True)]
        report["variants"][variant] = {
            "state": reranker.compile_state,
            "load_and_warm_s": round(loaded, 1),
            "buckets": getattr(reranker.backend.compiled, "warmed", None),
            "recompiles_while_timed": counters["stats"]["unique_graphs"] - graphs,
            "pairs_ms_p50": round(float(np.percentile(prepare_s, 50)) * 1000, 2),
            "model_ms_p50": round(float(np.percentile(model_s, 50)) * 1000, 2),
            "model_ms_mean": round(float(np.mean(model_s)) * 1000, 2),
            "spearman_vs_eager": round(float(np.mean(rho)), 4),
        }
        print(variant, report["variants"][variant], flush=True)
        write_result(out / "compiled-reranker.json", report)
        del reranker
    return 0


def _where(parser: argparse.ArgumentParser, verb: str, chosen: list[str]) -> None:
    """The CLI's --index-dir and --data on ``verb``'s parser, only when it is the verb run: they
    come from the settings model (pydantic), and ``run`` starts on a machine whose wheels are not
    installed yet."""
    if chosen[:1] == [verb]:
        from benchmarks import options

        options.add(parser, *options.WHERE)


def main(argv: list[str] | None = None) -> int:
    chosen = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_kit", description=__doc__)
    sub = p.add_subparsers(dest="verb", required=True)
    pl = sub.add_parser("plan", help="the calls, what each carries and runs, and their expected minutes")
    pl.add_argument("--json", action="store_true", help="each call's minutes and the total, as JSON")
    pk = sub.add_parser("pack", help="here: write the parts and manifest into .gpukit/")
    _where(pk, "pack", chosen)
    pk.add_argument("--out", type=Path, default=Path(KIT_DIR))
    rn = sub.add_parser("run", help="there: take the carried part, install when complete, run stages")
    rn.add_argument("--stages", default="", help=f"comma-separated, of {', '.join(s.name for s in STAGES)}")
    rn.add_argument("--out", type=Path, required=True, help="where results.tar.gz goes (the device's $OUT)")
    rh = sub.add_parser("rehearse", help=f"here, on a CPU: the stages {', '.join(REHEARSED)}, small")
    rh.add_argument("--stages", default=",".join(REHEARSED), help="comma-separated (default: all of them)")
    _where(rh, "rehearse", chosen)
    rh.add_argument("--out", type=Path, required=True, help="where each stage's log and results go")
    for verb in ("check", "http", "micro", *REHEARSED):
        stage_parser = sub.add_parser(verb, help=f"(a stage of run) {verb}")
        stage_parser.add_argument("--out", type=Path, required=True)
        if verb in (*REHEARSED, "micro"):
            stage_parser.add_argument("--small", action="store_true", help="the rehearsal's sizes, on a CPU")
    args = p.parse_args(argv)
    if args.verb == "plan":
        manifest = Path(KIT_DIR) / MANIFEST
        parts = len(json.loads(manifest.read_text())["parts"]) if manifest.is_file() else 1
        if args.json:
            minutes = plan_minutes(parts)
            print(json.dumps({"calls_minutes": minutes, "total_minutes": sum(minutes), "at_most": LEASE_MINUTES}))
            return 0
        print(describe(parts))
        print(f"stage batches: {BATCHES}")
        return 0
    if args.verb == "pack":
        from benchmarks import options
        from benchmarks.gpu_kit.pack import pack

        options.resolve(args)
        manifest = pack(args.index_dir, args.data_dir, args.out)
        print(json.dumps(manifest, indent=2))
        print(describe(len(manifest["parts"])))
        return 0
    if args.verb == "run":
        from benchmarks.gpu_kit.target import run

        return run([s for s in args.stages.split(",") if s], args.out)
    if args.verb == "rehearse":
        from benchmarks import options
        from benchmarks.gpu_kit.target import rehearse

        options.resolve(args)
        return rehearse([s for s in args.stages.split(",") if s], args.index_dir, args.data_dir, args.out)
    if args.verb == "compiled":
        return compiled(args.out, args.small)
    if args.verb == "micro":
        from benchmarks.gpu_kit.micro import micro

        return micro(args.out, args.small)
    if args.verb == "dense":
        from benchmarks.gpu_kit.dense import dense

        return dense(args.out, args.small)
    if args.verb in SERVING:
        return serving(args.out, args.verb, args.small)
    return {"check": check, "http": http}[args.verb](args.out)


if __name__ == "__main__":
    sys.exit(main())
