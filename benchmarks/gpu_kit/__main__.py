"""python -m benchmarks.gpu_kit plan | pack | run | check | http (see docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.gpu_kit.plan import BATCHES, KIT_DIR, MANIFEST, REHEARSED, STAGES, describe
from engine.settings import EngineSettings

HTTP_CLIENTS = (1, 8, 64)
# the new stages' sizes on the GPU, and in the CPU rehearsal (`rehearse`), which runs them small
FULL = {"workers": 4, "clients": HTTP_CLIENTS, "queries": None, "compiled_queries": 50}
SMALL = {"workers": 2, "clients": (1, 4), "queries": 40, "compiled_queries": 8}


def check(out: Path) -> int:
    """What the stages ran on: GPU, driver, versions, and that Lucene, FAISS and the encoder load."""
    import importlib.metadata as md

    import torch

    from engine.search import HybridEngine
    from offline.records import write_result

    engine = HybridEngine(EngineSettings(rerank=False))
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
    """The index's reranker (its own length), or on a machine that trained none an untrained MiniLM
    cross-encoder at the GPU recipe's 256 tokens: the same compute."""
    index_reranker = Path(os.environ["HYBRID_SEARCH_INDEX_DIR"]) / "reranker"
    if index_reranker.is_dir():
        return str(index_reranker), None
    from engine.retrieval.encoder import DEFAULT_ENCODER, resolve_model
    from index_build.train_reranker import TRAIN_MAX_LENGTH

    return resolve_model(DEFAULT_ENCODER), TRAIN_MAX_LENGTH


def _reranker_args() -> list[str]:
    path, max_length = _reranker()
    return ["--reranker", path] + (["--max-length", str(max_length)] if max_length else [])


def _dev_queries(limit: int | None = None) -> list[str]:
    from offline.dataset import load_dataset

    return list(load_dataset(Path(os.environ["HYBRID_SEARCH_DATA_DIR"])).split_queries("dev").values())[:limit]


def http(out: Path) -> int:
    """``hybrid-search serve`` on the GPU, then REST and A2A end to end at 1, 8 and 64 clients."""
    from agents.door_load import bench_http
    from benchmarks.reliability.server import free_port, start_server, stop_server
    from offline.latency import save

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


def workers(out: Path, shared: bool, small: bool) -> int:
    """``serve --workers N`` end to end through REST: each worker with its own reranker (stage
    ``workers``), or every worker's pairs scored by the one reranker process (stage ``shared``)."""
    import httpx

    from agents.door_load import bench_http
    from benchmarks.reliability.server import free_port, start_server, stop_server
    from offline.latency import save

    scale = SMALL if small else FULL
    queries = _dev_queries(scale["queries"])
    port = free_port()
    name = "workers-shared-reranker" if shared else "workers-own-reranker"
    args = ["serve", "--mcp-port", str(port), "--no-a2a", "--workers", str(scale["workers"])]
    args += ["--shared-reranker", "on" if shared else "off", *_reranker_args()]
    args += ["--rerank-cache-size", "0"]  # every query scored: the runs repeat the queries the warm-up asked
    url = f"http://127.0.0.1:{port}"
    server = start_server(args, f"{url}/health", out / f"{name}-server.log")
    try:
        bench_http("rest", f"{url}/search_nfcorpus", queries[:10], [1])  # warm-up: every worker's first queries
        report = bench_http("rest", f"{url}/search_nfcorpus", queries, list(scale["clients"]))
        health = httpx.get(f"{url}/health", timeout=30).json()
        report |= {"workers": scale["workers"], "shared_reranker": shared, "device": health["device"]}
        report |= {key: health.get(key) for key in ("reranker", "reranker_runtime", "rerank_depth", "reranker_process")}
        print(json.dumps(report["runs"]), flush=True)
        save(report, name, out)
    finally:
        print(f"server exit code {stop_server(server)}")
    return 0


def compiled(out: Path, small: bool) -> int:
    """The served reranker (torch) eager and compiled over its buckets: ms for one query's pairs,
    the warm-up, and rank agreement; compiling is CUDA's only, so a CPU times eager alone."""
    import time

    import numpy as np
    import torch

    from benchmarks.gpu_rerank import _pairs, _spearman
    from engine.rerank.cross_encoder import Reranker
    from offline.records import write_result

    scale = SMALL if small else FULL
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path, max_length = _reranker()
    settings = EngineSettings()
    per_query = _pairs(scale["compiled_queries"], settings.rerank_depth_for(device))
    report: dict = {"device": device, "reranker": path, "queries": len(per_query), "variants": {}}
    reference: list[np.ndarray] = []
    for variant, compile_model in (("eager", False), ("compiled", True)):
        if compile_model and device != "cuda":
            report["variants"][variant] = {"skipped": "compiling is for CUDA only (rerank_compile)"}
            continue
        started = time.perf_counter()
        batch = settings.rerank_batch_for(device)
        reranker = Reranker(path, device, max_length, batch, "torch", "none", compile_model=compile_model)
        loaded = time.perf_counter() - started
        reranker.score_pairs(per_query[0][1])
        times, scores = [], []
        for _, pairs in per_query:
            started = time.perf_counter()
            scores.append(np.array(reranker.score_pairs(pairs)))
            times.append(time.perf_counter() - started)
        reference = reference or scores
        rho = [_spearman(r, g) for r, g in zip(reference, scores, strict=True)]
        report["variants"][variant] = {
            "load_and_warm_s": round(loaded, 1),
            "ms_per_query_p50": round(float(np.percentile(times, 50)) * 1000, 2),
            "ms_per_query_mean": round(float(np.mean(times)) * 1000, 2),
            "spearman_vs_eager": round(float(np.mean(rho)), 4),
        }
        print(variant, report["variants"][variant], flush=True)
    write_result(out / "compiled-reranker.json", report)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_kit", description=__doc__)
    sub = p.add_subparsers(dest="verb", required=True)
    sub.add_parser("plan", help="the calls, what each carries and runs, and their expected minutes")
    pk = sub.add_parser("pack", help="here: write the parts and manifest into .gpukit/")
    pk.add_argument("--index-dir", type=Path, default=Path("indexes/nfcorpus"))
    pk.add_argument("--data", type=Path, default=Path("../shared/datasets/nfcorpus"))
    pk.add_argument("--out", type=Path, default=Path(KIT_DIR))
    rn = sub.add_parser("run", help="there: take the carried part, install when complete, run stages")
    rn.add_argument("--stages", default="", help=f"comma-separated, of {', '.join(s.name for s in STAGES)}")
    rn.add_argument("--out", type=Path, required=True, help="where results.tar.gz goes (the device's $OUT)")
    rh = sub.add_parser("rehearse", help=f"here, on a CPU: the stages {', '.join(REHEARSED)}, small")
    rh.add_argument("--stages", default=",".join(REHEARSED), help="comma-separated (default: all three)")
    rh.add_argument("--index-dir", type=Path, default=Path("indexes/nfcorpus"))
    rh.add_argument("--data", type=Path, default=Path("../shared/datasets/nfcorpus"))
    rh.add_argument("--out", type=Path, required=True, help="where each stage's log and results go")
    for verb in ("check", "http", *REHEARSED):
        stage_parser = sub.add_parser(verb, help=f"(a stage of run) {verb}")
        stage_parser.add_argument("--out", type=Path, required=True)
        if verb in REHEARSED:
            stage_parser.add_argument("--small", action="store_true", help="the rehearsal's sizes, on a CPU")
    args = p.parse_args(argv)
    if args.verb == "plan":
        manifest = Path(KIT_DIR) / MANIFEST
        parts = len(json.loads(manifest.read_text())["parts"]) if manifest.is_file() else 1
        print(describe(parts))
        print(f"stage batches: {BATCHES}")
        return 0
    if args.verb == "pack":
        from benchmarks.gpu_kit.pack import pack

        manifest = pack(args.index_dir, args.data, args.out)
        print(json.dumps(manifest, indent=2))
        print(describe(len(manifest["parts"])))
        return 0
    if args.verb == "run":
        from benchmarks.gpu_kit.target import run

        return run([s for s in args.stages.split(",") if s], args.out)
    if args.verb == "rehearse":
        from benchmarks.gpu_kit.target import rehearse

        return rehearse([s for s in args.stages.split(",") if s], args.index_dir, args.data, args.out)
    if args.verb == "compiled":
        return compiled(args.out, args.small)
    if args.verb in ("workers", "shared"):
        return workers(args.out, args.verb == "shared", args.small)
    return {"check": check, "http": http}[args.verb](args.out)


if __name__ == "__main__":
    sys.exit(main())
