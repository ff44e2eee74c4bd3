"""Trial: LambdaMART fusion learned on the train judgments, against the served RRF, on dev.

    python -m benchmarks.learned_fusion --train-queries 1500

Features per candidate (the fused top 100): BM25 rank and score, dense rank and score, judgment
memory rank and vote, RRF rank and score, how many retrievers found it, query length. Training
queries are left out of the judgment memory when their own features are computed. With a reranker
installed, each fusion is also scored with its head reranked as the engine reranks (served depth and
blend). Writes ``benchmarks/results/learned-fusion-dev.json``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

from engine.config import Settings
from engine.dataset import load_dataset
from engine.evaluation import continue_with_fused, evaluate_run
from engine.fusion import reciprocal_rank_fusion
from engine.pipeline import HybridEngine

DEPTH = 100


def candidates(engine: HybridEngine, text: str, exclude: str | None) -> tuple[np.ndarray, list[tuple[str, float]]]:
    s = engine.settings
    vector = engine.dense.encode_query(text)
    found = {
        "bm25": engine.bm25.search(text, DEPTH),
        "dense": engine.dense.search(vector, DEPTH),
        "memory": engine.memory.search(vector, DEPTH, exclude=exclude),
    }
    fused = reciprocal_rank_fusion(
        {name: [d for d, _ in hits] for name, hits in found.items()},
        k=s.rrf_k,
        weights={"bm25": s.bm25_weight, "dense": s.dense_weight, "memory": s.memory_weight},
    )[:DEPTH]
    lookup = {name: {d: (r, sc) for r, (d, sc) in enumerate(hits, 1)} for name, hits in found.items()}
    rows = []
    for rank, (doc_id, score) in enumerate(fused, 1):
        per = [lookup[name].get(doc_id, (DEPTH + 1, 0.0)) for name in ("bm25", "dense", "memory")]
        hits = sum(doc_id in lookup[name] for name in lookup)
        rows.append([v for pair in per for v in pair] + [rank, score, hits, len(text.split())])
    return np.asarray(rows, dtype=np.float32), fused


def main() -> None:
    import lightgbm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-queries", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = Settings()
    dataset = load_dataset(settings.data_dir)
    engine = HybridEngine(settings)
    train_split = engine.manifest.memory["split"]
    train, dev = dataset.qrels(train_split), dataset.qrels("dev")
    rng = random.Random(args.seed)
    train_ids = rng.sample(sorted(train), min(args.train_queries, len(train)))
    features, labels, groups = [], [], []
    for qid in train_ids:
        x, fused = candidates(engine, dataset.queries[qid], exclude=qid)
        features.append(x)
        labels += [train[qid].get(d, 0) for d, _ in fused]
        groups.append(len(fused))
    dev_items = [(qid, candidates(engine, text, exclude=None)) for qid, text in dataset.split_queries("dev").items()]
    rerank_scores: dict[str, dict[str, float]] = {q: {} for q, _ in dev_items}  # shared by every fusion
    report: dict[str, dict] = {}

    def scored(name: str, ranked: dict[str, list[tuple[str, float]]]) -> None:
        run = {q: [d for d, _ in ranking] for q, ranking in ranked.items()}
        report[name] = evaluate_run(dev, run)
        if engine.reranker is not None:
            reranked = {}
            for q, ranking in ranked.items():
                head = engine.rerank(dataset.queries[q], ranking, rerank_scores[q])
                reranked[q] = continue_with_fused([d for d, _ in head], run[q])
            report[f"{name} + rerank"] = evaluate_run(dev, reranked)

    scored("rrf (served)", {q: fused for q, (_, fused) in dev_items})
    for leaves, trees in ((15, 200), (31, 300)):
        model = lightgbm.LGBMRanker(
            objective="lambdarank",
            n_estimators=trees,
            num_leaves=leaves,
            learning_rate=0.05,
            label_gain=[0, 1, 3],
            random_state=args.seed,
            deterministic=True,  # the same model from the same data: runs are comparable
            force_row_wise=True,
            verbose=-1,
        )
        model.fit(np.vstack(features), np.asarray(labels), group=groups)
        ranked = {}
        for q, (x, fused) in dev_items:
            predicted = model.predict(x)
            ranked[q] = [(fused[i][0], float(predicted[i])) for i in np.argsort(-predicted, kind="stable")]
        scored(f"lambdamart {leaves} leaves, {trees} trees", ranked)
    out = Path("benchmarks/results/learned-fusion-dev.json")
    out.write_text(
        json.dumps(
            {
                "train_split": train_split,
                "train_queries": len(train_ids),
                "reranker": (
                    {"name": engine.reranker.name, "max_length": engine.reranker.max_length}
                    if engine.reranker
                    else None
                ),
                "rerank_depth": settings.rerank_depth_for(engine.device) if engine.reranker else 0,
                "rerank_blend": settings.rerank_blend,
                "dev": report,
            },
            indent=2,
        )
        + "\n"
    )
    for name, metrics in report.items():
        scores = "  ".join(f"{m} {metrics[m]:.4f}" for m in ("nDCG@5", "nDCG@10", "in-list NDCG@5"))
        print(f"{name:32s} {scores}")


if __name__ == "__main__":
    main()
