"""Trial: LambdaMART fusion sizes against RRF on dev, each also with its head reranked as served.

    python -m benchmarks.learned_fusion

The model ``build`` and ``train-fusion`` serve is the first variant (``index_build.train_fusion``:
15 leaves, 200 trees, every training query); the others show how much the size matters. Every
variant is trained on the same features (training queries left out of the judgment memory), saved
and loaded the way the engine loads it. With a reranker installed, each fusion's head is also
reranked as the engine reranks (served depth and blend). Writes
``benchmarks/results/learned-fusion-dev.json``.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from tqdm import tqdm

from engine.fusion.learned import MODEL_FILE, LearnedFusion
from engine.search import HybridEngine
from engine.settings import EngineSettings
from index_build.train_fusion import LEAVES, TREES, collect, fit, training_split
from offline.dataset import load_dataset
from offline.evaluation import continue_with_fused, evaluate_run, paired_test
from offline.records import write_result

VARIANTS = ((LEAVES, TREES), (31, 300), (7, 100))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-queries", type=int, help="sample this many training queries (default all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/learned-fusion-dev.json"))
    args = parser.parse_args()
    settings = EngineSettings(fusion="rrf")
    dataset = load_dataset(settings.data_dir)
    engine = HybridEngine(settings)
    plain = HybridEngine(settings.model_copy(update={"rerank": False}))  # training features need no reranking
    split = training_split(engine.manifest, dataset)
    train = dataset.qrels(split)
    train_ids = sorted(q for q, docs in train.items() if any(g > 0 for g in docs.values()))
    if args.train_queries:
        train_ids = random.Random(args.seed).sample(train_ids, min(args.train_queries, len(train_ids)))
    features = collect(plain, dataset, train, train_ids)
    dev = dataset.qrels("dev")
    results = {q: engine.stages(t, top_k=1) for q, t in tqdm(dataset.split_queries("dev").items(), desc="dev")}
    report: dict[str, dict] = {}
    runs: dict[str, dict[str, list[str]]] = {}

    def scored(name: str, ranked: dict[str, list[tuple[str, float]]]) -> None:
        runs[name] = {q: [d for d, _ in ranking[:100]] for q, ranking in ranked.items()}
        report[name] = evaluate_run(dev, runs[name])
        if engine.reranker is not None:
            reranked = {}
            for q, ranking in ranked.items():
                head = engine.rerank(
                    dataset.queries[q], ranking, results[q].rerank_scores, vector=results[q].query_vector
                )
                reranked[q] = continue_with_fused([d for d, _ in head], runs[name][q])
            report[f"{name} + rerank"] = evaluate_run(dev, reranked)

    scored("rrf", {q: r.rrf for q, r in results.items()})
    for leaves, trees in VARIANTS:
        with tempfile.TemporaryDirectory() as folder:
            fit(*features, leaves=leaves, trees=trees, seed=args.seed).booster_.save_model(f"{folder}/{MODEL_FILE}")
            fusion = LearnedFusion(folder)
        name = f"lambdamart {leaves} leaves, {trees} trees"
        scored(name, {q: fusion.rank(dataset.queries[q], r.retrieved, r.rrf) for q, r in results.items()})
        report[name]["vs rrf"] = paired_test(dev, runs[name], runs["rrf"])
    described = {k: v for k, v in engine.describe().items() if k != "fusion"}  # fusion: each variant's own
    body = {"train_split": split, "train_queries": len(train_ids), **described, "dev": report}
    write_result(args.output, body, vars(args))
    for name, metrics in report.items():
        scores = "  ".join(f"{m} {metrics[m]:.4f}" for m in ("nDCG@5", "nDCG@10", "Recall@100", "in-list NDCG@5"))
        print(f"{name:40s} {scores}")


if __name__ == "__main__":
    main()
