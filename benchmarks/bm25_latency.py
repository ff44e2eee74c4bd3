"""BM25 latency: ``LuceneIndex.search`` of this tree against a baseline revision's, in one process
on one index, one thread and two side by side, plain and filtered.

    python -m benchmarks.bm25_latency --baseline 651ddb2

The baseline's ``engine/retrieval/lucene.py`` is read from git and loaded beside this tree's; both
open the index read-only and answer the same searches (checked). Rounds alternate between the two,
so that a shared machine's changing load falls on both; searches a second are the best round's. Writes
``cpu-2core/bm25-latency.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine.settings import EngineSettings
from engine.store.index_dir import BM25_DIR
from index_build.settings import BuildSettings
from offline.dataset import load_dataset
from offline.latency import percentiles
from offline.records import write_result

_MODULE = "engine/retrieval/lucene.py"


def _baseline(revision: str):
    """The baseline's lucene module, loaded from its source at ``revision``."""
    source = subprocess.run(["git", "show", f"{revision}:{_MODULE}"], capture_output=True, text=True, check=True)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "lucene_baseline.py"
        path.write_text(source.stdout)
        spec = importlib.util.spec_from_file_location("lucene_baseline", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def _timed(index, queries: list[str], k: int, allowed, threads: int) -> tuple[list[float], float]:
    """Seconds per search, and searches a second: every thread runs every query (each from its own start)."""

    def run(offset: int) -> list[float]:
        took = []
        for query in queries[offset:] + queries[:offset]:
            started = time.perf_counter()
            index.search(query, k, allowed)
            took.append(time.perf_counter() - started)
        return took

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        samples = [s for part in pool.map(run, [i * len(queries) // threads for i in range(threads)]) for s in part]
    return samples, len(samples) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bm25", type=Path, default=Path(EngineSettings().index_dir) / BM25_DIR, help="a Lucene index")
    parser.add_argument("--baseline", required=True, help="git revision whose LuceneIndex is the 'before'")
    parser.add_argument("--data", type=Path, default=BuildSettings().data_dir)
    parser.add_argument("--split", default="dev")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--k", type=int, default=EngineSettings().bm25_depth)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/cpu-2core/bm25-latency.json"))
    args = parser.parse_args()

    from engine.retrieval.lucene import LuceneIndex

    queries = list(load_dataset(args.data).split_queries(args.split).values())[: args.queries]
    indexes = {"before": _baseline(args.baseline).LuceneIndex(args.bm25), "after": LuceneIndex(args.bm25)}
    found = sorted({unit for query in queries for unit, _ in indexes["after"].search(query, 1000)})
    half = set(random.Random(0).sample(found, len(found) // 2))  # a filter: half the chunks the queries match
    for query in queries:
        for allowed in (None, half):
            if indexes["before"].search(query, args.k, allowed) != indexes["after"].search(query, args.k, allowed):
                raise SystemExit(f"before and after differ on {query!r} (filtered: {allowed is not None})")

    cases = {"1 thread": (None, 1), "2 threads": (None, 2), "filtered, 1 thread": (half, 1)}
    samples = {(case, name): [] for case in cases for name in indexes}
    rates = {(case, name): [] for case in cases for name in indexes}
    for _ in range(args.rounds):
        for case, (allowed, threads) in cases.items():
            for name, index in indexes.items():
                took, rate = _timed(index, queries, args.k, allowed, threads)
                samples[case, name] += took
                rates[case, name].append(rate)
    result = {
        "queries": len(queries),
        "k": args.k,
        "filter_units": len(half),
        "baseline": args.baseline,
        "cases": {
            case: {
                name: percentiles(samples[case, name]) | {"searches_per_s": max(rates[case, name])} for name in indexes
            }
            for case in cases
        },
    }
    for case, by_name in result["cases"].items():
        print(case, {name: f"p50 {r['p50']:.3f} ms, {r['searches_per_s']:.0f}/s" for name, r in by_name.items()})
    write_result(args.output, result, vars(args))


if __name__ == "__main__":
    main()
