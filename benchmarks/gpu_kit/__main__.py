"""python -m benchmarks.gpu_kit plan | pack | run | check | http (see docs/gpu.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.gpu_kit.plan import BATCHES, KIT_DIR, MANIFEST, STAGES, describe
from engine.settings import EngineSettings

HTTP_CLIENTS = (1, 8, 64)


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


def http(out: Path) -> int:
    """``hybrid-search serve`` on the GPU, then REST and A2A end to end at 1, 8 and 64 clients."""
    from agents.door_load import bench_http
    from benchmarks.reliability.server import free_port, start_server, stop_server
    from offline.dataset import load_dataset
    from offline.latency import save

    queries = list(load_dataset(Path(os.environ["HYBRID_SEARCH_DATA_DIR"])).split_queries("dev").values())
    rest, a2a = free_port(), free_port()
    args = ["serve", "--mcp-port", str(rest), "--a2a-port", str(a2a)]
    if not (Path(os.environ["HYBRID_SEARCH_INDEX_DIR"]) / "reranker").is_dir():
        # a machine that did not train one times an untrained MiniLM cross-encoder (the same compute)
        from engine.retrieval.encoder import DEFAULT_ENCODER, resolve_model
        from index_build.train_reranker import TRAIN_MAX_LENGTH

        args += ["--reranker", resolve_model(DEFAULT_ENCODER)]
        args += ["--max-length", str(TRAIN_MAX_LENGTH)]
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
    for verb in ("check", "http"):
        sub.add_parser(verb, help=f"(a stage of run) {verb}").add_argument("--out", type=Path, required=True)
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
    return {"check": check, "http": http}[args.verb](args.out)


if __name__ == "__main__":
    sys.exit(main())
