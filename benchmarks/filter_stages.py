"""Where a filtered search's time goes: each filter's stages (encoding, each retriever and the
fusion over both passes, where the search within the filter ran), in process, one query at a time,
no reranker, beside the same queries unfiltered, the cases in turn query by query after the served
warm-up (docs/filters.md, "At a million chunks"); with ``--clients N``, also each case's queries/s
with N threads searching at once.

    python -m benchmarks.filter_stages --index-dir /tmp/t66-run/index-300000 \\
        --data /tmp/t66-run/corpus-300000 --filter 'reviews={"document_types": ["review"]}'
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from engine import threads
from engine.documents import SearchFilters
from engine.search import HybridEngine
from engine.search.stages import run_stages
from engine.settings import EngineSettings
from offline.dataset import load_dataset
from offline.latency import machine_name, percentiles
from offline.records import write_result


def named_filter(text: str) -> tuple[str, SearchFilters]:
    """``NAME=FILTERS_JSON`` (a request's ``filters``)."""
    name, _, body = text.partition("=")
    try:
        return name, SearchFilters.model_validate(json.loads(body))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=FILTERS_JSON ({exc})") from None


def main() -> None:
    threads.for_queries()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index-dir", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="the dataset whose dev queries are asked")
    parser.add_argument("--filter", type=named_filter, action="append", required=True, help="NAME=FILTERS_JSON")
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument(
        "--spare-threads", type=int, default=EngineSettings().spare_threads, help="the setting (0: passes in turn)"
    )
    parser.add_argument(
        "--clients", type=int, default=0, help="also each case's queries/s with this many threads searching at once"
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    engine = HybridEngine(EngineSettings(index_dir=args.index_dir, rerank=False, spare_threads=args.spare_threads))
    engine.warm_up(engine.settings.warmup_searches)
    queries = list(load_dataset(args.data).split_queries("dev").values())[: args.queries]
    for query in queries[:20]:
        engine.search(query, 10)
    cases = {"unfiltered": None, **dict(args.filter)}
    chunks, found = engine.store.count(), {}
    for name, filters in list(cases.items())[1:]:
        began = time.perf_counter()
        engine.search(queries[0], 10, filters)
        share = len(engine.index.allowed(filters)) / chunks
        found[name] = {"first_ms": round((time.perf_counter() - began) * 1000, 1), "share_of_chunks": round(share, 4)}
    laps, totals = {name: [] for name in cases}, {name: [] for name in cases}
    for turn, query in enumerate(queries):
        for name in list(cases)[turn % len(cases) :] + list(cases)[: turn % len(cases)]:
            began = time.perf_counter()
            result = run_stages(engine, query, 10, None, cases[name])
            totals[name].append(time.perf_counter() - began)
            laps[name].append(result.seconds)
    loaded = {name: _per_second(engine, queries, filters, args.clients) for name, filters in cases.items()}
    engine.close()
    for name in cases:
        stages = {lap: round(1000 * float(np.median([s[lap] for s in laps[name]])), 1) for lap in laps[name][0]}
        found[name] = found.get(name, {}) | {"ms": percentiles(totals[name]), "stage_p50_ms": stages}
        if args.clients:
            found[name]["queries_per_s"] = {"clients": args.clients, "rate": loaded[name]}
        print(name, json.dumps(found[name]), flush=True)
    output = args.output or Path("benchmarks/results") / machine_name() / f"filter-stages-{args.index_dir.name}.json"
    print(f"wrote {write_result(output, {'cases': found}, vars(args))}")


def _per_second(engine: HybridEngine, queries: list[str], filters, clients: int) -> float | None:
    """Every query searched once by ``clients`` threads at once: queries a second."""
    if not clients:
        return None
    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda q: engine.search(q, 10, filters), queries))
    return round(len(queries) / (time.perf_counter() - began), 1)


if __name__ == "__main__":
    main()
