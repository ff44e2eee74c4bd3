"""An evaluation's stage runs scored as ranked and source-collapsed (issue 66): each distractor
read as the abstract it was made from, repeats dropped (:func:`benchmarks.peers_at_size.collapsed`),
so that a family whose distractors copy abstracts is also read as "found the right abstract".

The runs are the ``run.<stage>.trec`` files ``hybrid-search evaluate --output DIR`` writes (``python
-m benchmarks.scale --engine`` keeps them beside its summary); a judged query a stage found nothing
for scores 0, as the evaluation counts it.

    python -m benchmarks.collapsed_runs --runs benchmarks/results/cpu-2core/eval-dev-unjudged-titled-1000000 \\
        --corpus /tmp/hs-1m/corpus-unjudged-titled-1000000 --data ../shared/datasets/nfcorpus
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.peers_at_size import collapsed
from benchmarks.scale_engine import sources
from offline.dataset import load_dataset
from offline.evaluation import evaluate_run, read_trec_run
from offline.records import write_result


def main() -> None:
    head, _, rest = __doc__.strip().partition("\n\n")
    p = argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, required=True, help="the evaluation's folder of run.<stage>.trec files")
    p.add_argument("--corpus", type=Path, required=True, help="the corpus the index was built from (its sources)")
    p.add_argument("--data", type=Path, required=True, help="the dataset whose judgments score the runs")
    p.add_argument("--split", default="dev", help="the judged split (default dev)")
    p.add_argument("--output", type=Path, help="JSON file (default: collapsed.json in --runs)")
    args = p.parse_args()
    files = sorted(args.runs.glob("run.*.trec"))
    if not files:
        raise SystemExit(f"{args.runs}: no run.<stage>.trec files (hybrid-search evaluate --output writes them)")
    qrels, source = load_dataset(args.data).qrels(args.split), sources(args.corpus)
    scored = {}
    for path in files:
        run = read_trec_run(path)
        run.update({q: ["(none)"] for q in qrels if q not in run})  # found nothing: scores 0
        ranked, folded = evaluate_run(qrels, run), evaluate_run(qrels, collapsed(run, source))
        scored[path.stem.removeprefix("run.")] = {
            "nDCG@10": ranked["nDCG@10"],
            "nDCG@10 source-collapsed": folded["nDCG@10"],
            "Recall@100": ranked["Recall@100"],
        }
        print(path.stem, {k: round(v, 4) for k, v in scored[path.stem.removeprefix("run.")].items()}, flush=True)
    write_result(args.output or args.runs / "collapsed.json", {"runs": str(args.runs), "stages": scored}, vars(args))


if __name__ == "__main__":
    main()
