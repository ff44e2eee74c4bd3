"""Is ``similarity_score`` a probability? Its reliability on dev judgments.

    python -m benchmarks.calibration --split dev --top-k 10

For every dev query, the served pipeline's top ``k`` hits (with and without the reranker when
one is installed) are scored by the calibration fitted at build time on training judgments, and
compared with the dev judgments (relevant = grade > 0; unjudged counts as not relevant, as
trec_eval counts it). Reports the expected calibration error over ten bins, the table behind it
and a reliability plot. Writes ``benchmarks/results/calibration-<split>.json`` and ``.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks import options
from engine.fusion.calibration import expected_calibration_error
from engine.search import HybridEngine
from offline.dataset import load_dataset
from offline.progress import track
from offline.records import write_result


def main() -> None:
    parser = options.parser(__doc__, *options.WHERE, split=True)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results"), help="the results' folder")
    args, settings = options.load(parser)
    dataset = load_dataset(settings.build.data_dir)
    qrels = dataset.qrels(args.split)
    engine = HybridEngine(settings.engine)
    if engine.fusion is None or engine.fusion.calibration is None:
        raise SystemExit("this index has no calibration: rebuild it, or run `hybrid-search train-fusion`")
    rankings = {"fused": ([], [])} | ({"reranked (served)": ([], [])} if engine.reranker is not None else {})
    queries = {q: t for q, t in dataset.split_queries(args.split).items() if q in qrels}
    for qid, text in track(queries.items(), "calibration", "query"):
        result = engine.stages(text, args.top_k)
        for name, (probs, labels) in rankings.items():
            ranking = (result.reranked if name.startswith("reranked") else result.fused)[: args.top_k]
            probs += engine.similarity(result, ranking)
            labels += [qrels[qid].get(d, 0) > 0 for d, _ in ranking]
    report = {
        "split": args.split,
        "top_k": args.top_k,
        "queries": len(queries),
        "calibration": vars(engine.fusion.calibration),
        "rankings": {},
    }
    for name, (probs, labels) in rankings.items():
        ece, table = expected_calibration_error(np.array(probs), np.array(labels))
        report["rankings"][name] = {
            "ece": ece,
            "mean_predicted": float(np.mean(probs)),
            "observed_rate": float(np.mean(labels)),
            "bins": table,
        }
    path = write_result(args.output / f"calibration-{args.split}.json", report, vars(args))
    _plot(report, path.with_suffix(".png"))
    print(json.dumps({k: {"ece": v["ece"], "observed": v["observed_rate"]} for k, v in report["rankings"].items()}))


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", label="perfect")
    for name, data in report["rankings"].items():
        xs = [b["predicted"] for b in data["bins"]]
        ys = [b["observed"] for b in data["bins"]]
        ax.plot(xs, ys, marker="o", label=f"{name}, ECE {data['ece']:.3f}")
    ax.set(
        xlabel="similarity_score (predicted probability of relevance)",
        ylabel="observed rate on judgments",
        title=f"Reliability on {report['split']}, top {report['top_k']}",
        xlim=(0, 1),
        ylim=(0, 1),
    )
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
