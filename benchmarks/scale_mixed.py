"""The dense index ``auto`` chooses on a corpus whose vectors do not cluster, and what serving it
costs: ``python -m benchmarks.scale_mixed --passages 300000 --baseline indexes/nfcorpus``.

The corpus is NFCorpus plus N passages that each mix a sentence or two of four random NFCorpus
abstracts (in a shuffled order); a passage's vector is the normalised mean of those four abstracts'
vectors plus Gaussian noise (sigma 0.03 a dimension), renormalised. Unlike copies of one abstract
(:mod:`benchmarks.scale_engine`), such vectors fill the space between the abstracts: an inverted file's
lists no longer hold a query's neighbours together. Every tenth passage is a ``review``. The build
takes the vectors with ``--vectors`` and ``--dense-index auto``; then: the choice and its reason
(the manifest), recall@100 against exact search on 200 dev queries (encoded as the server encodes
them; a graph's at each efSearch, a refined scan's at each k_factor), the dense stage and the whole
query in process (200 dev queries, no reranker), and ``serve --workers 2`` through REST at 1 and 64
clients, after the 3.6k index of ``--baseline`` measured the same way in the same run
(:func:`benchmarks.scale_serving.measure`).
"""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import options
from benchmarks.scale_engine import Block, corpus_beside
from benchmarks.scale_serving import measure
from offline.dataset import load_dataset
from offline.records import write_result

ROOT = Path(__file__).resolve().parents[1]
NOISE_SIGMA = 0.03
MIXED = 4  # abstracts a passage mixes
CORPUS_VERSION = 1


def make_corpus(data: Path, index_dir: Path, n: int, out: Path) -> Path:
    """``out``: NFCorpus and ``n`` passages each mixing a sentence or two of :data:`MIXED` random
    abstracts, its vector their vectors' normalised mean plus noise (:func:`corpus_beside`)."""

    def mixed(records: list[dict], known: np.ndarray) -> Block:
        rng, shuffle = np.random.default_rng(0), random.Random(0)
        sentences = [[s for s in re.split(r"(?<=[.!?])\s+", r["text"]) if s] or [r["title"]] for r in records]

        def block(start: int, size: int) -> tuple[np.ndarray, list[dict]]:
            sources = rng.integers(0, len(records), (size, MIXED))
            mean = known[sources].mean(axis=1)
            mean /= np.linalg.norm(mean, axis=1, keepdims=True)
            noisy = mean + rng.normal(0, NOISE_SIGMA, (size, known.shape[1])).astype(np.float32)
            made = []
            for i, four in enumerate(sources):
                picked = []
                for source in four:
                    own = sentences[source]
                    at = shuffle.randrange(len(own))
                    picked += own[at : at + shuffle.choice((1, 2))]
                shuffle.shuffle(picked)
                kind = "review" if (start + i) % 10 == 0 else "abstract"
                made.append(
                    {"_id": f"M{start + i}", "title": "", "text": " ".join(picked), "metadata": {"document_type": kind}}
                )
            return noisy, made

        return block

    return corpus_beside(data, index_dir, n, out, CORPUS_VERSION, mixed)


def dev_recall(target: Path, vectors: Path, queries: list[str], manifest: dict) -> dict:
    """Recall@100 of the built dense index against exact search, on ``queries`` encoded by the
    index's encoder, searched as the engine searches it (its nprobe, or its efSearch; a graph's
    also at each efSearch from 128 to 2048)."""
    import faiss

    from engine.retrieval.encoder import encode, load_encoder
    from engine.settings import EngineSettings
    from index_build.dense_index import _exact

    encoder = load_encoder(manifest["encoder"], "cpu")
    probes = np.ascontiguousarray(encode(encoder, queries), dtype=np.float32)
    index = faiss.read_index(str(target / "dense.faiss"))
    kind = faiss.downcast_index(index.index) if isinstance(index, faiss.IndexIDMap2) else index
    truth = _exact(np.load(vectors, mmap_mode="r"), probes, 100, None)

    def recall() -> float:
        _, found = index.search(probes, 100)
        return round(float(np.mean([len(set(f) & set(t)) / 100 for f, t in zip(found, truth, strict=True)])), 4)

    if isinstance(kind, faiss.IndexRefine):  # a refined scan: as built, and at each k_factor
        built = kind.k_factor
        swept = {}
        for factor in (1, 2, 4, 8, 16):
            kind.k_factor = factor
            swept[factor] = recall()
        kind.k_factor = built
        return {"queries": len(queries), "k_factor": built, "recall_at_100": recall(), "by_k_factor": swept}
    if not hasattr(kind, "hnsw"):
        return {"queries": len(queries), "recall_at_100": recall()}
    built = kind.hnsw.efSearch  # as a server searches it: the build's, or the setting's if wider
    swept = {}
    for ef in (128, 256, 512, 1024, 2048):
        kind.hnsw.efSearch = ef
        swept[ef] = recall()
    kind.hnsw.efSearch = max(built, EngineSettings().hnsw_ef_search)
    return {"queries": len(queries), "ef_search": kind.hnsw.efSearch, "recall_at_100": recall(), "by_ef_search": swept}


def in_process(target: Path, queries: list[str]) -> dict:
    """Each stage's time over ``queries`` one at a time, no reranker (``engine.stages``), warmed as a server warms."""
    from engine.search import HybridEngine, SearchOptions
    from engine.settings import EngineSettings
    from offline.latency import percentiles

    engine = HybridEngine(EngineSettings(index_dir=target, rerank=False))
    try:
        engine.warm_up(engine.settings.warmup_searches)
        options = SearchOptions(rerank_depth=0)
        per_stage: dict[str, list[float]] = {}
        for query in queries:
            for stage, seconds in engine.stages(query, 10, options=options).seconds.items():
                per_stage.setdefault(stage, []).append(seconds)
        return {stage: percentiles(times) for stage, times in per_stage.items() if times}
    finally:
        engine.close()


def main() -> None:
    p = options.parser(__doc__, "data_dir", output="{machine}/scale-mixed.json", help={"data_dir": "NFCorpus"})
    p.add_argument("--passages", type=int, default=300_000, help="mixed passages added to NFCorpus")
    p.add_argument("--source-index", type=Path, default=ROOT / "indexes" / "nfcorpus", help="NFCorpus's vectors")
    p.add_argument("--baseline", type=Path, help="the small index served the same way first (a copy)")
    p.add_argument("--work", type=Path, default=Path("/tmp/hybrid-search-scale-mixed"))
    args, _ = options.load(p)
    args.work.mkdir(parents=True, exist_ok=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()[:20]
    report: dict = {"passages": args.passages, "lscpu": lscpu}
    started = time.perf_counter()
    corpus = make_corpus(args.data_dir, args.source_index, args.passages, args.work / f"corpus-{args.passages}")
    report["corpus_seconds"] = round(time.perf_counter() - started, 1)
    target = args.work / f"index-{args.passages}"
    if not (target / "manifest.json").is_file():
        vectors = str(corpus / "vectors.npy")
        build = ["build", "--data", str(corpus), "--index-dir", str(target), "--vectors", vectors]
        started = time.perf_counter()
        with open(args.work / "build.log", "w") as log:
            subprocess.run(
                [sys.executable, "-m", "cli.main", *build, "--dense-index", "auto"],
                cwd=ROOT,
                check=True,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        report["build_seconds"] = round(time.perf_counter() - started, 1)
    manifest = json.loads((target / "manifest.json").read_text())
    report["dense"] = manifest["settings"]["dense"]
    print(json.dumps(report["dense"]), flush=True)
    queries = list(load_dataset(args.data_dir).split_queries("dev").values())[:200]
    report["dev_recall"] = dev_recall(target, corpus / "vectors.npy", queries, manifest)
    print(report["dev_recall"], flush=True)
    report["in_process_ms"] = in_process(target, queries)
    print(json.dumps(report["in_process_ms"]), flush=True)
    if args.baseline is not None:
        copy = args.work / "baseline"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(args.baseline, copy)
        report["baseline_in_process_ms"] = in_process(copy, queries)  # REST's own cost, read at both sizes
        report["baseline_serving"] = measure(copy, queries, args.work / "baseline.log", False)
        print(report["baseline_serving"], flush=True)
    report["serving"] = measure(target, queries, args.work / "index.log", False)
    if args.baseline is not None:
        at_64 = [run for run in report["serving"]["rest"] if run["concurrency"] == 64]
        base_64 = [run for run in report["baseline_serving"]["rest"] if run["concurrency"] == 64]
        if at_64 and base_64 and base_64[0].get("qps"):
            report["qps_64_over_baseline"] = round(at_64[0]["qps"] / base_64[0]["qps"], 3)
    print(json.dumps(report.get("serving")), flush=True)
    write_result(args.output, report, vars(args))


if __name__ == "__main__":
    main()
