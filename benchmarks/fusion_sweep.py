"""Sweep RRF k, per-retriever weights and judgment-memory neighbours on a split (dev).

    python -m benchmarks.fusion_sweep --split dev

Retrieval runs once per query; fusion is recomputed for every setting, so the sweep is cheap.
Writes ``benchmarks/results/fusion-sweep-<split>.json``: ``rows`` sorted by nDCG@10.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from benchmarks import options
from engine.fusion.rrf import reciprocal_rank_fusion
from engine.retrieval.protocol import Query, Within
from engine.search import HybridEngine
from offline.dataset import load_dataset
from offline.evaluation import evaluate_run
from offline.records import write_result


def main() -> None:
    args, settings = options.load(options.parser(__doc__, *options.WHERE, split=True))
    dataset = load_dataset(args.data_dir)
    qrels, queries = dataset.qrels(args.split), dataset.split_queries(args.split)
    engine = HybridEngine(settings.with_values(rerank=False).engine)
    vectors = {q: engine.dense.encode_query(t) for q, t in queries.items()}
    bm25 = {q: [d for d, _ in engine.bm25.retrieve(Query(t, None), 100, Within())] for q, t in queries.items()}
    dense = {q: [d for d, _ in engine.dense.retrieve(Query("", vectors[q]), 100, Within())] for q in queries}
    rows = []
    for neighbors in (5, 10, 15, 20):
        memory = {
            q: [d for d, _ in engine.memory.retrieve(Query("", vectors[q]), 100, Within(), neighbors)] for q in queries
        }
        for k, w_bm25, w_dense, w_memory in itertools.product(
            (10, 30, 60, 100), (0.5, 1.0), (0.5, 1.0), (1.0, 1.5, 2.0)
        ):
            run = {
                q: [
                    d
                    for d, _ in reciprocal_rank_fusion(
                        {"bm25": bm25[q], "dense": dense[q], "memory": memory[q]},
                        k=k,
                        weights={"bm25": w_bm25, "dense": w_dense, "memory": w_memory},
                    )
                ][:100]
                for q in queries
            }
            metrics = evaluate_run(qrels, run)
            rows.append(
                {
                    "memory_neighbors": neighbors,
                    "rrf_k": k,
                    "bm25_weight": w_bm25,
                    "dense_weight": w_dense,
                    "memory_weight": w_memory,
                    **metrics,
                }
            )
    rows.sort(key=lambda r: -r["nDCG@10"])
    write_result(Path("benchmarks/results") / f"fusion-sweep-{args.split}.json", {"rows": rows}, vars(args))
    for row in rows[:8]:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    default = next(
        r
        for r in rows
        if (r["memory_neighbors"], r["rrf_k"], r["bm25_weight"], r["dense_weight"], r["memory_weight"])
        == (10, 60, 1.0, 1.0, 1.0)
    )
    print(
        "default",
        {k: round(v, 4) if isinstance(v, float) else v for k, v in default.items()},
        "rank",
        rows.index(default) + 1,
        "of",
        len(rows),
    )


if __name__ == "__main__":
    main()
