"""Sweep rerank depth and the reranker/fusion blend on a split (dev), with the installed reranker.

    python -m benchmarks.rerank_sweep --split dev --depths 6,10,15,20,30 [--fusion rrf]

The cross-encoder scores each query's fused top ``max(depths)`` once; every (depth, blend) setting
is then recomputed from those scores, so the sweep costs one reranking pass. Each row carries its
nDCG@10 gain over the fused order and a paired t-test's p-value. Writes
``benchmarks/results/rerank-sweep-<split>-<fusion>.json``: ``rows`` sorted by nDCG@10.
"""

from __future__ import annotations

from tqdm import tqdm

from benchmarks import options
from engine.fusion.rrf import blend_reranking
from engine.search import HybridEngine
from offline.dataset import load_dataset
from offline.evaluation import continue_with_fused, evaluate_run, paired_test
from offline.records import write_result

BLENDS = (0.0, 0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.8, 1.0)


def main() -> None:
    parser = options.parser(
        __doc__, *options.WHERE, "reranker", "max_length", split=True, output="rerank-sweep-{split}-{fusion}.json"
    )
    parser.add_argument("--depths", default="6,10,15,20,30", help="comma-separated rerank depths")
    # not the setting: the sweep reranks one fusion's order, learned by default
    parser.add_argument(
        "--fusion", choices=["learned", "rrf"], default="learned", help="fusion to rerank (default learned)"
    )
    args, loaded = options.load(parser)
    depths = sorted(int(d) for d in args.depths.split(","))
    dataset = load_dataset(args.data_dir)
    qrels, queries = dataset.qrels(args.split), dataset.split_queries(args.split)
    settings = loaded.with_values(rerank_depth=depths[-1], rerank_blend=1.0, fusion=args.fusion).engine
    engine = HybridEngine(settings)
    if engine.reranker is None:
        raise SystemExit(f"no reranker at {settings.reranker_path}: train one with `hybrid-search train-reranker`")
    results = {}
    for qid, text in tqdm(queries.items(), desc="reranking", unit="query"):
        result = engine.stages(text, top_k=1)
        results[qid] = (result.fused[:100], result.rerank_scores)
    fused_run = {qid: [d for d, _ in fused] for qid, (fused, _) in results.items()}
    rows = []
    for depth in depths:
        for blend in BLENDS:
            run = {}
            for qid, (fused, scores) in results.items():
                head = fused[:depth]
                blended = blend_reranking(head, [scores[d] for d, _ in head], blend)
                run[qid] = continue_with_fused([d for d, _ in blended], fused_run[qid])
            test = paired_test(qrels, run, fused_run)
            rows.append(
                {
                    "fusion": args.fusion,
                    "depth": depth,
                    "blend": blend,
                    "max_length": engine.reranker.max_length,
                    **evaluate_run(qrels, run),
                    "gain_ndcg@10": test["gain"],
                    "p_value": test["p_value"],
                }
            )
    rows.sort(key=lambda r: -r["nDCG@10"])
    write_result(args.output, {"rows": rows}, vars(args))
    for row in rows:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})


if __name__ == "__main__":
    main()
