"""Does a learned fusion trained on one distractor family hold on another (issue 66)? Each index
built by ``python -m benchmarks.scale --engine --family F`` is searched with its own learned fusion
and with every other family's, on the split's judged queries, reranker off.

A fusion trained where distractors copy judged abstracts can learn "absent from the memory means a
copy"; one trained where they copy only unjudged abstracts cannot. Scored as ranked and
source-collapsed (:func:`benchmarks.peers_at_size.collapsed`).

    python -m benchmarks.fusion_families \\
        --family copies=/tmp/hs-1m/index,/tmp/hs-1m/corpus-copies-1000000 \\
        --family unjudged=/tmp/hs-1m/index-unjudged-1000000,/tmp/hs-1m/corpus-unjudged-1000000
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.peers import open_engine
from benchmarks.peers_at_size import DEPTH, collapsed
from benchmarks.scale_engine import sources
from engine import threads
from engine.fusion.learned import LearnedFusion
from engine.search.results import SearchOptions
from engine.store.index_dir import FUSION_DIR
from offline.dataset import load_dataset
from offline.evaluation import evaluate_run
from offline.latency import machine_name
from offline.records import write_result


def family(text: str) -> tuple[str, Path, Path]:
    """``NAME=INDEX_DIR,CORPUS_DIR``."""
    name, _, where = text.partition("=")
    index_dir, _, corpus = where.partition(",")
    if not (name and index_dir and corpus):
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=INDEX_DIR,CORPUS_DIR")
    return name, Path(index_dir), Path(corpus)


def main() -> None:
    threads.for_queries()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", type=family, action="append", required=True, help="NAME=INDEX_DIR,CORPUS_DIR")
    parser.add_argument("--split", default="dev")
    parser.add_argument(
        "--output", type=Path, default=Path("benchmarks/results") / machine_name() / "fusion-families.json"
    )
    args = parser.parse_args()
    models = {name: LearnedFusion(index_dir / FUSION_DIR) for name, index_dir, _ in args.family}
    table = []
    for name, index_dir, corpus in args.family:
        dataset, source = load_dataset(corpus), sources(corpus)
        qrels, queries = dataset.qrels(args.split), dataset.split_queries(args.split)
        engine = open_engine(index_dir)
        for trained_on, model in models.items():
            choice = SearchOptions(fusion=model)
            run = {q: [hit.doc_id for hit in engine.search(text, DEPTH, options=choice)] for q, text in queries.items()}
            raw, folded = evaluate_run(qrels, run), evaluate_run(qrels, collapsed(run, source))
            table.append(
                {
                    "index": name,
                    "fusion_trained_on": trained_on,
                    "nDCG@10": raw["nDCG@10"],
                    "nDCG@10 source-collapsed": folded["nDCG@10"],
                    "Recall@100": raw["Recall@100"],
                    "queries": raw["queries"],
                }
            )
            print(json.dumps(table[-1]), flush=True)
        engine.close()
    out = write_result(args.output, {"split": args.split, "depth": DEPTH, "rows": table}, vars(args))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
