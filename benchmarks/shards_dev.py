"""One index against the same corpus in shards, every stage's dev rankings side by side.

    python -m benchmarks.shards_dev --index-dir indexes/nfcorpus --sharded-dir indexes/nfcorpus-4

Both indexes must be of the same corpus (``build`` and ``build --shards N``). Each split query is
run through both in this process (no reranker), and for every stage the JSON
(``benchmarks/results/<machine>/shards-dev.json``) records each index's metrics and how many
rankings differ at depth 100. The learned stage is compared twice: with the sharded build's own
fusion (trained on the shards' candidates), and with the one index's model read by the sharded
index (what the shards retrieve, apart from what LightGBM learned from them), with a paired test
between the two learned runs.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from benchmarks import options
from engine.search import HybridEngine
from engine.store.index_dir import FUSION_DIR, read_manifest
from offline.dataset import load_dataset
from offline.evaluation import evaluate_run, paired_test, stage_runs
from offline.records import write_result


def _runs(settings, index_dir: Path, queries: dict[str, str]) -> dict:
    engine = HybridEngine(settings.engine.model_copy(update={"index_dir": index_dir}))
    try:
        return stage_runs(engine, queries, progress=False)
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = options.parser(__doc__, *options.WHERE, split=True, output="{machine}/shards-dev.json")
    parser.add_argument("--sharded-dir", type=Path, required=True, help="the same corpus built with --shards N")
    args, loaded = options.load(parser, argv)
    settings = loaded.with_values(device="cpu", rerank=False)
    dataset = load_dataset(args.data_dir)
    qrels, queries = dataset.qrels(args.split), dataset.split_queries(args.split)
    work = Path(tempfile.mkdtemp(prefix="shards-dev-"))
    try:
        borrowed = work / "sharded-with-one-index-model"  # the sharded index reading the one index's fusion
        shutil.copytree(args.sharded_dir, borrowed, ignore=shutil.ignore_patterns(FUSION_DIR))
        shutil.copytree(args.index_dir / FUSION_DIR, borrowed / FUSION_DIR)
        one = _runs(settings, args.index_dir, queries)
        sharded = _runs(settings, args.sharded_dir, queries)
        sharded_borrowed = _runs(settings, borrowed, queries)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report: dict = {"split": args.split, "queries": len(queries), "shards": read_manifest(args.sharded_dir).shards}
    for stage in one:
        report[stage] = {
            "one_index": evaluate_run(qrels, one[stage]),
            "sharded": evaluate_run(qrels, sharded[stage]),
            "rankings_differing": sum(sharded[stage][q] != one[stage][q] for q in queries),
        }
    report["learned_with_one_index_model"] = {
        "sharded": evaluate_run(qrels, sharded_borrowed["learned"]),
        "rankings_differing": sum(sharded_borrowed["learned"][q] != one["learned"][q] for q in queries),
    }
    report["learned_sharded_vs_one_index"] = paired_test(qrels, sharded["learned"], one["learned"])
    for stage, found in report.items():
        if isinstance(found, dict) and "rankings_differing" in found:
            print(stage, found["rankings_differing"], flush=True)
    write_result(args.output, report, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
