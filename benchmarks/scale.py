"""How the dense index's cost grows with the corpus: exact, HNSW and IVF at 10k to 1M documents.

    python -m benchmarks.scale --sizes 10000,100000,1000000

Synthetic documents are made from NFCorpus's own embeddings (each one the normalised mix of two
real abstracts' vectors plus a little noise), so the vectors have the real distribution without
encoding a million texts on a CPU; queries are the real dev queries. Per size and index kind:
build seconds, index bytes, p50/p95 query milliseconds (one query at a time) and recall@10
against exact search. Encoding cost is linear and measured separately (``hybrid-search build``).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

from benchmarks.scale_engine import FAMILIES
from engine.retrieval.dense import build_faiss
from engine.retrieval.encoder import encode, load_encoder
from engine.settings import EngineSettings
from engine.store.index_dir import DENSE_FILE
from offline.dataset import load_dataset
from offline.latency import machine_name, percentiles
from offline.records import write_result
from serving.settings import Settings

HNSW_LIMIT = 200_000  # HNSW over 1M vectors takes many minutes to build on 2 cores: opt in with --hnsw-limit


def synthetic(base: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    a, b = rng.integers(0, len(base), n), rng.integers(0, len(base), n)
    mix = rng.uniform(0.5, 1.0, (n, 1)).astype(np.float32)
    vectors = mix * base[a] + (1 - mix) * base[b] + rng.normal(0, 0.02, (n, base.shape[1])).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def build(kind: str, vectors: np.ndarray):
    import faiss

    if kind == "ivf":
        nlist = int(4 * np.sqrt(len(vectors)))
        index = faiss.index_factory(vectors.shape[1], f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
        index.train(vectors[: min(len(vectors), 64 * nlist)])
        index.add(vectors)
        index.nprobe = 16
        return index
    index = build_faiss(vectors, kind)
    if kind == "hnsw":
        faiss.downcast_index(index.index).hnsw.efSearch = EngineSettings().hnsw_ef_search  # as the engine searches
    return index


def main() -> None:
    import faiss

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--hnsw-limit", type=int, default=HNSW_LIMIT, help="largest size to build HNSW for")
    parser.add_argument(
        "--engine",
        action="store_true",
        help="the whole engine instead: NFCorpus plus --distractors passages, built with --vectors, evaluated on"
        " dev and timed (benchmarks/scale_engine.py)",
    )
    parser.add_argument("--distractors", type=int, default=1_000_000, help="with --engine: passages added")
    parser.add_argument(
        "--family",
        choices=FAMILIES,
        default="copies",
        help="with --engine: which abstracts the distractors copy (benchmarks/scale_engine.py)",
    )
    parser.add_argument(
        "--resume-check",
        action="store_true",
        help="with --engine: build again, kill it with SIGKILL at half the first build's time, run it again,"
        " and compare the two builds' dev rankings",
    )
    parser.add_argument(
        "--timing-only",
        action="store_true",
        help="with --engine: time the index an earlier run left in --work, in process, without building it again",
    )
    parser.add_argument(
        "--choice",
        action="store_true",
        help="the dense index `build` chooses (auto) at each of --sizes, vectors streamed through a file in --work"
        " (benchmarks/scale_choice.py)",
    )
    parser.add_argument(
        "--work", type=Path, default=Path("/tmp/hybrid-search-scale"), help="with --engine or --choice: where files go"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # the phases' progress
    settings = Settings()
    name = f"{args.distractors}" if args.family == "copies" else f"{args.family}-{args.distractors}"
    if args.engine and args.timing_only:  # the index an earlier run built in --work, timed again
        from benchmarks.scale_engine import time_in_process

        found = time_in_process(args.work / f"corpus-{name}", args.work / f"index-{name}")
        print(json.dumps(found, indent=2))
        out = Path("benchmarks/results") / machine_name() / f"scale-engine-{name}-timing.json"
        write_result(out, found, vars(args))
        return
    if args.engine:
        from benchmarks.scale_engine import run

        out = Path("benchmarks/results") / machine_name()
        found = run(
            settings.build.data_dir,
            settings.engine.index_dir,
            args.distractors,
            args.work,
            out,
            args.resume_check,
            args.family,
        )
        print(json.dumps(found, indent=2))
        write_result(out / f"scale-engine-{name}.json", found, vars(args))
        return
    flat = faiss.read_index(str(settings.engine.index_dir / DENSE_FILE))
    base = flat.reconstruct_n(0, flat.ntotal)
    dataset = load_dataset(settings.build.data_dir)
    texts = list(dataset.split_queries("dev").values())[: args.queries]
    queries = encode(load_encoder(settings.build.encoder, "cpu"), texts)
    if args.choice:
        from benchmarks.scale_choice import measure

        out = Path("benchmarks/results") / machine_name()
        for size in (int(s) for s in args.sizes.split(",")):
            found = measure(base, queries, size, args.work)
            print(json.dumps(found, indent=2), flush=True)
            write_result(out / f"scale-choice-{size}.json", found, vars(args))
        return
    rng = np.random.default_rng(0)
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        vectors = synthetic(base, size, rng)
        truth = None
        for kind in ("flat", "ivf", "hnsw"):
            if kind == "hnsw" and size > args.hnsw_limit:
                continue
            started = time.perf_counter()
            index = build(kind, vectors)
            build_s = time.perf_counter() - started
            latencies, found = [], []
            for q in queries:
                t = time.perf_counter()
                _, ids = index.search(q.reshape(1, -1), 10)
                latencies.append(time.perf_counter() - t)
                found.append(ids[0])
            if kind == "flat":
                truth = found
            recall = float(np.mean([len(set(f) & set(t)) / 10 for f, t in zip(found, truth, strict=True)]))
            row = {
                "documents": size,
                "index": kind,
                "build_s": round(build_s, 2),
                "bytes": int(faiss.serialize_index(index).size),
                "recall@10_vs_exact": recall,
                **{f"query_ms_{k}": v for k, v in percentiles(latencies).items() if k in ("p50", "p95")},
            }
            rows.append(row)
            print(row, flush=True)
            del index
    out = Path("benchmarks/results") / machine_name()
    write_result(out / "scale.json", {"rows": rows}, vars(args))
    plot(rows, out / "scale.png")
    print(f"saved {out / 'scale.json'} and scale.png")


def plot(rows: list[dict], path: Path) -> None:
    """Query p50 and index size against corpus size, one line per index kind (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (latency, size) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in sorted({r["index"] for r in rows}):
        mine = [r for r in rows if r["index"] == kind]
        xs = [r["documents"] for r in mine]
        latency.plot(xs, [r["query_ms_p50"] for r in mine], marker="o", label=kind)
        size.plot(xs, [r["bytes"] / 2**20 for r in mine], marker="o", label=kind)
    for ax, label in ((latency, "query p50 (ms)"), (size, "index size (MiB)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("documents")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("dense index cost by corpus size")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
