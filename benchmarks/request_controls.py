"""A request's own fusion and reranking on the split's queries: one retriever alone, weights, explain.

    python -m benchmarks.request_controls --index-dir indexes/nfcorpus --data ../shared/datasets/nfcorpus

Three measurements, in this process, as a door's request reaches the engine (``SearchRequest``,
then ``HybridEngine.options_for``). ``alone``: for every split query, the request
``{"fusion": {"method": "rrf", "weights": {R: 1, the others: 0}}, "rerank": {"enabled": false}}``
answers exactly the retriever R's own ranking (its top 100, as the stage returned it), for each
retriever of the index; the JSON counts the queries that differ (0 expected). ``weights``: the
split's metrics for a few per-request weightings beside the default request. ``explain``: the p50
and p95 of a whole search with ``explain`` off and on, interleaved query by query, in turn first.
"""

from __future__ import annotations

import statistics
import time

from benchmarks import options
from engine.documents import SearchRequest
from engine.search import HybridEngine
from offline.dataset import load_dataset
from offline.evaluation import evaluate_run
from offline.records import write_result

DEPTH = 100
WEIGHTINGS = {  # name -> the request's controls (beside the default request, which sets none)
    "rrf as served": {"fusion": {"method": "rrf"}},
    "rrf 1/1/1": {"fusion": {"method": "rrf", "weights": {"bm25": 1, "dense": 1, "memory": 1}}},
    "rrf bm25 2": {"fusion": {"method": "rrf", "weights": {"bm25": 2}}},
    "rrf dense 0.5": {"fusion": {"method": "rrf", "weights": {"dense": 0.5}}},
    "rrf no bm25": {"fusion": {"method": "rrf", "weights": {"bm25": 0}}},
    "rrf no memory": {"fusion": {"method": "rrf", "weights": {"memory": 0}}},
    "learned, dense 0.5": {"fusion": {"method": "learned", "weights": {"dense": 0.5}}},
}


def _ids(engine: HybridEngine, text: str, top_k: int = DEPTH, **controls) -> list[str]:
    request = SearchRequest(query=text, top_k=top_k, **controls)
    return [hit.doc_id for hit in engine.search(request.query, top_k, options=engine.options_for(request))]


def alone(engine: HybridEngine, queries: dict[str, str]) -> dict:
    """Per retriever: the queries whose one-retriever request differs from the retriever's ranking."""
    names = [name for name, retriever in engine.retrievers().items() if retriever is not None]
    differing = dict.fromkeys(names, 0)
    for text in queries.values():
        stages = engine.stages(text, DEPTH)
        for name in names:
            weights = {other: float(other == name) for other in engine.retrievers()}
            controls = {"fusion": {"method": "rrf", "weights": weights}, "rerank": {"enabled": False}}
            differing[name] += _ids(engine, text, **controls) != [d for d, _ in stages.retrieved[name][:DEPTH]]
    return {"queries": len(queries), "depth": DEPTH, "differing": differing}


def weightings(engine: HybridEngine, queries: dict[str, str], qrels) -> dict:
    """The split's metrics of the default request and of each of :data:`WEIGHTINGS`."""
    table = {}
    for name, controls in {"default request": {}, **WEIGHTINGS}.items():
        if controls.get("fusion", {}).get("method") == "learned" and engine.fusion is None:
            continue
        run = {qid: _ids(engine, text, **controls) for qid, text in queries.items()}
        table[name] = {"controls": controls, **evaluate_run(qrels, run)}
    return table


def explain_cost(engine: HybridEngine, queries: dict[str, str], top_k: int = 10) -> dict:
    """Seconds a whole search takes with ``explain`` off and on, each query once each way, interleaved
    (which way goes first alternates: the second search of a query ran faster either way)."""
    took: dict[str, list[float]] = {"off": [], "on": []}
    for i, text in enumerate(queries.values()):
        for way in ("off", "on")[:: 1 if i % 2 else -1]:
            started = time.perf_counter()
            _ids(engine, text, top_k, explain=way == "on")
            took[way].append(time.perf_counter() - started)
    ms = {
        way: {"p50_ms": statistics.median(s) * 1000, "p95_ms": statistics.quantiles(s, n=20)[-1] * 1000}
        for way, s in took.items()
    }
    return {**ms, "p50_cost": ms["on"]["p50_ms"] / ms["off"]["p50_ms"] - 1, "top_k": top_k}


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__, *options.WHERE, split=True, output="{machine}/request-controls-dev.json")
    args, settings = options.load(parser, argv)
    dataset = load_dataset(args.data_dir)
    qrels, queries = dataset.qrels(args.split), dataset.split_queries(args.split)
    engine = HybridEngine(settings.engine)
    try:
        engine.warm_up(settings.engine.warmup_searches)
        report = {
            "split": args.split,
            "served": engine.describe()["fusion"],
            "reranker": engine.describe()["reranker"],
            "alone": alone(engine, queries),
            "weights": weightings(engine, queries, qrels),
            "explain": explain_cost(engine, queries),
        }
    finally:
        engine.close()
    write_result(args.output, report, vars(args))
    print(report["alone"], {k: round(v["nDCG@10"], 4) for k, v in report["weights"].items()}, report["explain"])
    print(f"written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
